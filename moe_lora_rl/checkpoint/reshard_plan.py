"""The reshard read plan of the training checkpoint (pure), and the run identity a load must match.

A checkpoint stores each adapter factor (and each of its Adam moments, which have the factor's shape and sharding)
as slices of its global canonical tensor: (global_shape, dim, start, stop), one owner per replica set. Loading at
another layout reads, for the slice [lo, hi) along `dim` that this rank needs, the overlapping part of every stored
slice: `plan_reads` says which, and refuses when the stored slices do not cover the need.
"""
from __future__ import annotations

from dataclasses import dataclass

RESHARDABLE_META = ("layout", "world_size")
"""run_meta keys that may differ between save and load (adapters and optimizer state reshard)."""


def check_run_meta(saved: dict, current: dict, where: str) -> None:
    """The run identity must match, except the keys in RESHARDABLE_META. The model is identified by its content
    (model_identity.py), not its path; LoRA configs are compared by what changes the adapters' shapes or function."""
    from ..lora.config import LoRAConfig
    from .model_identity import check_same_model

    for key in sorted(set(saved) | set(current)):
        if key in RESHARDABLE_META:
            continue
        if key not in saved or key not in current:
            have = "the checkpoint" if key in saved else "this run"
            raise ValueError(f"{where}: run_meta key {key!r} is only in {have}")
        a, b = saved[key], current[key]
        if key == "model" and isinstance(a, dict) and isinstance(b, dict):
            check_same_model(a, b, where)
        elif key == "lora" and isinstance(a, dict) and isinstance(b, dict):
            LoRAConfig.from_dict(b).check_compatible(LoRAConfig.from_dict(a), where)
        elif a != b:
            raise ValueError(f"{where}: run_meta {key!r} mismatch: checkpoint {a!r}, this run {b!r}")


@dataclass(frozen=True)
class Piece:
    """One stored slice of a global tensor: entries [start, stop) along dim (dim None: the whole tensor)."""

    file: str
    key: str
    global_shape: tuple[int, ...]
    dim: int | None
    start: int
    stop: int


@dataclass(frozen=True)
class Read:
    """Copy src.narrow(dim, src_lo, n) into dst.narrow(dim, dst_lo, n) (dst: the slice this rank needs, or the
    whole tensor); dim None: copy the whole stored tensor."""

    file: str
    key: str
    dim: int | None
    src_lo: int
    dst_lo: int
    n: int


def plan_reads(name: str, pieces: list[Piece], global_shape: tuple[int, ...], dim: int | None, lo: int,
               hi: int) -> list[Read]:
    """Reads assembling [lo, hi) along `dim` of `name` (dim None: the whole tensor) from stored pieces.
    ValueError when a piece's global shape or shard dim disagrees, or the pieces leave part of the need uncovered."""
    if not pieces:
        raise ValueError(f"{name} is missing from the checkpoint")
    for p in pieces:
        if tuple(p.global_shape) != tuple(global_shape):
            raise ValueError(f"{name} has global shape {list(p.global_shape)} in the checkpoint, the model expects "
                             f"{list(global_shape)}")
    whole = [p for p in pieces if p.dim is None]
    if whole:                                         # a replicated tensor: one copy holds everything
        p = whole[0]
        if dim is None:
            return [Read(p.file, p.key, None, 0, 0, global_shape[0])]
        return [Read(p.file, p.key, dim, lo, 0, hi - lo)]
    d = pieces[0].dim
    if any(p.dim != d for p in pieces):
        raise ValueError(f"{name}: stored slices disagree on the shard dim")
    if dim is not None and dim != d:
        raise ValueError(f"{name} is sharded on dim {d} in the checkpoint, the model shards dim {dim}")
    need_lo, need_hi = (lo, hi) if dim is not None else (0, global_shape[d])
    reads, covered = [], []
    for p in sorted(pieces, key=lambda p: p.start):
        a, b = max(need_lo, p.start), min(need_hi, p.stop)
        if a < b and not any(x <= a and b <= y for x, y in covered):
            reads.append(Read(p.file, p.key, d, a - p.start, a - need_lo, b - a))
            covered.append((a, b))
    pos = need_lo
    for a, b in sorted(covered):
        if a > pos:
            break
        pos = max(pos, b)
    if pos < need_hi:
        raise ValueError(f"{name} is only partly present in the checkpoint (entries [{pos}, {need_hi}) of dim {d} "
                         "are missing)")
    return reads
