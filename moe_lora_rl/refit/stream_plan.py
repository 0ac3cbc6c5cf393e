"""Streaming refit plan (pure): which rank sends every adapter factor, in which bucket, as which PEFT tensors.

Built from what each rank reports about its factors (name, global shape, how it is sharded, which ranks hold the
shards, whether it is this replica set's sender) and checked against the factors the architecture and LoRA
config must produce: every factor has exactly one sender, every bucket has one sender and fits `bucket_bytes`
(a factor with its PEFT copies larger than the budget is an error naming it). Unit-testable without processes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lora.config import LoRAConfig
from ..models.arch import MoEArch
from ..models.naming import AdapterName, naming_for
from ..transfer.push_plan import layer_major
from ..transfer.wire import nbytes
from .rename import PeftOut, peft_outputs

DTYPE = torch.float32             # what travels (the full gather's dtype: bit-for-bit comparable)


@dataclass(frozen=True)
class FactorReport:
    """What one rank says about one of its factors."""
    factor: str
    shape: tuple[int, ...]        # global (canonical) shape
    shard_dim: int | None         # canonical dim split over `members`, None = whole on every member
    members: tuple[int, ...]      # global ranks of the gather group, in group-rank order (shard i on members[i])
    sends: bool                   # this rank is the sender of its replica set


@dataclass(frozen=True)
class Unit:
    factor: str
    shape: tuple[int, ...]
    shard_dim: int | None
    members: tuple[int, ...]
    sender: int
    outputs: tuple[PeftOut, ...]

    @property
    def nbytes(self) -> int:
        return sum(nbytes(o.shape, DTYPE) for o in self.outputs)


@dataclass(frozen=True)
class StreamBucket:
    index: int
    sender: int
    units: tuple[Unit, ...]

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def entries(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(o.name, DTYPE, o.shape) for u in self.units for o in u.outputs]


@dataclass(frozen=True)
class StreamPlan:
    buckets: tuple[StreamBucket, ...]
    bucket_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def send_bytes(self, rank: int) -> int:
        return sum(b.nbytes for b in self.buckets if b.sender == rank)

    def entries(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [e for b in self.buckets for e in b.entries()]


def expected_factors(arch: MoEArch, cfg: LoRAConfig) -> set[str]:
    """Every canonical factor the adapters of `cfg` have on a model of `arch` (all layers, all experts)."""
    naming, wanted, out = naming_for(arch), set(cfg.resolved_targets()), set()
    for layer in range(arch.num_layers):
        for li in naming.layer_linears(arch, layer):
            if li.target not in wanted:
                continue
            shared = cfg.expert_factors_shared(li.target) if li.part == "expert" else (False, False)
            for ab, is_shared in zip("AB", shared):
                experts = [None] if li.part != "expert" or is_shared else range(arch.num_experts)
                out |= {f"{AdapterName(li, layer, e).canonical}.lora_{ab}" for e in experts}
    return out


def _describe(factor: str, arch: MoEArch) -> str:
    name, _ = naming_for(arch).parse_canonical(factor)
    return f"expert {name.expert} of layer {name.layer} ({factor})" if name.expert is not None else factor


def plan_stream(reports: list[list[FactorReport]], arch: MoEArch, bucket_bytes: int,
                expected: set[str] | None = None) -> StreamPlan:
    """reports[rank]: that rank's factors. Buckets are filled greedily in layer-major order, one open bucket per
    sender; a bucket is closed (and numbered) when its next factor would overflow it."""
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    seen: dict[str, FactorReport] = {}
    senders: dict[str, list[int]] = {}
    for rank, facs in enumerate(reports):
        for f in facs:
            prev = seen.setdefault(f.factor, f)
            if (prev.shape, prev.shard_dim) != (f.shape, f.shard_dim):
                raise ValueError(f"adapter factor {f.factor}: ranks disagree on its shape or sharding "
                                 f"({prev.shape}/{prev.shard_dim} vs {f.shape}/{f.shard_dim})")
            if f.sends:
                senders.setdefault(f.factor, []).append(rank)
                if rank not in f.members:
                    raise ValueError(f"adapter factor {f.factor}: sender rank {rank} is not in its group {f.members}")
    if expected is not None:
        missing = sorted(expected - set(seen), key=layer_major)
        if missing:
            raise ValueError(f"no rank holds adapter factor {_describe(missing[0], arch)}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        extra = sorted(set(seen) - expected)
        if extra:
            raise ValueError(f"adapter factor {extra[0]} is not one the model's LoRA config produces")
    units = []
    for factor in sorted(seen, key=layer_major):
        who = senders.get(factor, [])
        if len(who) != 1:
            what = "no rank sends" if not who else f"ranks {who} all send"
            raise ValueError(f"owner map: {what} adapter factor {_describe(factor, arch)}")
        f = seen[factor]
        u = Unit(factor, f.shape, f.shard_dim, f.members, who[0], tuple(peft_outputs(arch, factor, f.shape)))
        if u.nbytes > bucket_bytes:
            raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than adapter tensor {factor} ({u.nbytes} "
                             f"bytes as {len(u.outputs)} PEFT tensors); use bucket_bytes >= {u.nbytes}")
        units.append(u)
    buckets: list[StreamBucket] = []
    open_: dict[int, list[Unit]] = {}
    filled: dict[int, int] = {}
    for u in units:
        cur = open_.setdefault(u.sender, [])
        if cur and filled[u.sender] + u.nbytes > bucket_bytes:
            buckets.append(StreamBucket(len(buckets), u.sender, tuple(cur)))
            cur.clear()
            filled[u.sender] = 0
        cur.append(u)
        filled[u.sender] = filled.get(u.sender, 0) + u.nbytes
    for sender in sorted(open_):
        if open_[sender]:
            buckets.append(StreamBucket(len(buckets), sender, tuple(open_[sender])))
    return StreamPlan(tuple(buckets), bucket_bytes)
