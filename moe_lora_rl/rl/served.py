"""keep_served=true (either mode, rank 0): the adapters of the last max_staleness + 1 pushed versions, as the engine
received them, and every trained sample with its per-token versions, written to out_dir/served/ so a check can
recompute each trained token with the version that produced it (tests/e2e/test_async.py: HF;
tests/e2e/test_train_families.py: the Megatron trainer, tests/kit/served_megatron.py).

    rec = ServedAdapters(out_dir, keep=k + 1)
    transport = rec.wrap(engine.transport)          # push through it: the tensors of each version are kept
    rec.record(step, samples)                       # served/step{n}.pt; each version's tensors once: served/v{n}.pt

A trained sample needing a version no longer kept is an error: with staleness <= k it cannot happen.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch


class _Keeping:
    """A Transport (transfer/interface.py) that keeps a copy of every bucket it sends, by version."""

    def __init__(self, inner, owner: "ServedAdapters"):
        self._inner, self._owner = inner, owner

    def send_bucket(self, version: int, index: int, tensors: dict):
        self._owner._add(version, {k: v.detach().clone() for k, v in tensors.items()})
        return self._inner.send_bucket(version, index, tensors)

    def call(self, method: str, *args):
        return self._inner.call(method, *args)

    def reset_prefix_cache(self) -> None:
        self._inner.reset_prefix_cache()


class ServedAdapters:
    def __init__(self, out_dir, keep: int):
        self.dir = Path(out_dir) / "served"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.kept: OrderedDict[int, dict] = OrderedDict()
        self.written: set[int] = set()

    def wrap(self, transport):
        return _Keeping(transport, self)

    def _add(self, version: int, tensors: dict) -> None:
        self.kept.setdefault(version, {}).update(tensors)
        self.kept.move_to_end(version)
        while len(self.kept) > self.keep:
            self.kept.popitem(last=False)

    def record(self, step: int, samples) -> None:
        needed = sorted({v for s in samples for v in s.versions if v is not None})
        for v in needed:
            if v in self.written:
                continue
            if v not in self.kept:
                raise RuntimeError(f"step {step}: a trained sample was served by version {v}, no longer kept "
                                   f"(kept: {sorted(self.kept)}, keep={self.keep})")
            torch.save(self.kept[v], self.dir / f"v{v}.pt")
            self.written.add(v)
        torch.save([{"prompt": list(s.prompt), "response": list(s.response), "logprobs": list(s.logprobs),
                     "versions": list(s.versions), "routes": s.routes} for s in samples],
                   self.dir / f"step{step}.pt")
