"""A dead engine during a collective push: what every rank learns of it, and rank 0's transport that stops sending
once it is found (rl/run.py's push and restarts use both)."""
from __future__ import annotations


def _died(e: BaseException) -> tuple[str, tuple[str, int]]:
    """What every rank learns of a dead engine: one line of its message, and which engine (rollout/replicas.py)."""
    return "died", (" ".join(str(e).split())[:300], getattr(e, "index", 0))


class _Survivor:
    """Rank 0's transport during a collective push (a Transport, transfer/interface.py, around the engines'): once
    the engine is found dead, the remaining buckets are not sent (the other ranks still stream theirs to the end) and
    the commit raises EngineDied, so that every rank leaves the push together and learns of it."""

    def __init__(self, inner):
        self._inner, self._died = inner, None

    def send_bucket(self, version, index, tensors):
        from ..rollout.client import EngineDied

        if self._died is None:
            try:
                return self._inner.send_bucket(version, index, tensors)
            except EngineDied as e:
                self._died = e

    def call(self, method, *args):
        if self._died is not None:
            raise self._died
        return self._inner.call(method, *args)

    def reset_prefix_cache(self) -> None:
        self._inner.reset_prefix_cache()
