"""Refit plan (pure): which PEFT tensors travel, in which bucket, and what the engine must end up with.

Built from the canonical adapter tensors' names and shapes only, so it is unit-testable without processes; the movers
execute it bucket by bucket and the engine activates the version only after the last bucket and the checksum match.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    index: int
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class RefitPlan:
    version: int
    buckets: tuple[Bucket, ...]
    total_bytes: int

    @property
    def names(self) -> list[str]:
        return [n for b in self.buckets for n in b.names]


def plan_buckets(version: int, sizes: dict[str, int], bucket_bytes: int = 64 << 20) -> RefitPlan:
    """Greedy in name order (layer-major, so a bucket holds neighbouring layers); a tensor larger than the budget
    gets a bucket of its own. sizes: PEFT name -> bytes."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets, cur, cur_bytes = [], [], 0
    for name in sorted(sizes, key=layer_major):
        n = sizes[name]
        if cur and cur_bytes + n > bucket_bytes:
            buckets.append(Bucket(len(buckets), tuple(cur), cur_bytes))
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += n
    if cur:
        buckets.append(Bucket(len(buckets), tuple(cur), cur_bytes))
    return RefitPlan(version, tuple(buckets), sum(sizes.values()))


def layer_major(name: str):
    """Sort key: global layer number (canonical layers.L... or PEFT ...layers.L...), then name."""
    from ..models.naming import layer_of

    layer = layer_of(name)
    return (-1 if layer is None else layer, name)
