"""Peak resident memory of everything a run starts: the sum of RSS over this process's descendants (torchrun and
its ranks, engine processes, a peer's own interpreter), sampled every `every_s` seconds in a thread.

    with PeakChildrenRss() as peak:
        run()
    peak.mb
"""
from __future__ import annotations

import threading

import psutil


class PeakChildrenRss:
    def __init__(self, every_s: float = 0.5):
        self.every_s, self.bytes = every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in me.children(recursive=True):
                try:
                    total += p.memory_info().rss
                except psutil.Error:                    # gone between listing and reading
                    pass
            self.bytes = max(self.bytes, total)
            self._stop.wait(self.every_s)

    @property
    def mb(self) -> float:
        return self.bytes / 2**20

    def __enter__(self) -> "PeakChildrenRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
