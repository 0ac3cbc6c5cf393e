"""Canonical adapter factors -> PEFT tensors (pure): which PEFT tensors a factor becomes, and where a slice of it
(a TP/ETP shard, or the whole factor) lands in each of them.

    A [r, in]                 copied to every HF module of a fused linear (q/k/v, gate/up share the A)
    B [out, r]                one HF module: as is
    B qkv [g*(q/g+2)*hd, r]   q/k/v interleaved per query group: split into q [nh*hd, r], k and v [nkv*hd, r]
    B glu [2, ffn, r]         gate = B[0], up = B[1]
    shared by all experts     the same factor for every expert's PEFT tensor

A shard of a factor maps to one contiguous block of every PEFT tensor it feeds, so a sender can fill a bucket
buffer shard by shard (refit/gather.py) and the whole-tensor export is the same code with one shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.arch import MoEArch
from ..models.naming import naming_for


@dataclass(frozen=True)
class PeftOut:
    name: str
    shape: tuple[int, ...]
    part: int                     # output part of the fused linear (q/k/v, gate/up), 0 when not split
    split: str                    # "copy" | "qkv" | "glu"


def peft_outputs(arch: MoEArch, factor: str, global_shape: tuple[int, ...]) -> list[PeftOut]:
    """The PEFT tensors a canonical factor (global name and shape) becomes."""
    naming = naming_for(arch)
    name, ab = naming.parse_canonical(factor)
    split = "copy" if ab == "A" or len(name.linear.hf) == 1 else ("qkv" if name.linear.target == "qkv" else "glu")
    out = []
    for peft, part in naming.peft_names(name, ab, arch.num_experts):
        if split == "copy":
            shape = tuple(global_shape)
        elif split == "glu":
            shape = tuple(global_shape[1:])
        else:
            rows = (arch.num_heads if part == 0 else arch.num_kv_heads) * arch.head_dim
            shape = (rows, global_shape[-1])
        out.append(PeftOut(peft, shape, part, split))
    return out


def place(out: PeftOut, shard: torch.Tensor, index: int, count: int, shard_dim: int | None,
          arch: MoEArch) -> tuple[tuple[slice, ...], torch.Tensor]:
    """(region of the PEFT tensor, values) for shard `index` of `count` of a canonical factor split on
    `shard_dim` (None: the whole factor)."""
    if shard_dim is None:
        index, count = 0, 1
    if out.split == "copy":
        if shard_dim is None:
            return (slice(None),) * shard.dim(), shard
        n = shard.shape[shard_dim]
        region = [slice(None)] * shard.dim()
        region[shard_dim] = slice(index * n, (index + 1) * n)
        return tuple(region), shard
    if out.split == "glu":                                   # canonical [2, ffn, r], sharded on dim 1
        piece = shard[out.part]
        n = piece.shape[0]
        return (slice(index * n, (index + 1) * n), slice(None)), piece
    qpg, hd, r = arch.num_heads // arch.num_kv_heads, arch.head_dim, shard.shape[-1]
    per = shard.reshape(-1, qpg + 2, hd, r)                  # [groups in this shard, q/g + 2, hd, r]
    g = per.shape[0]
    piece = per[:, :qpg].reshape(-1, r) if out.part == 0 else per[:, qpg + out.part - 1]
    piece = piece.reshape(-1, r)
    n = piece.shape[0]
    return (slice(index * n, (index + 1) * n), slice(None)), piece


def to_peft_tensors(adapters: dict[str, torch.Tensor], arch: MoEArch) -> dict[str, torch.Tensor]:
    """Full canonical adapters -> PEFT tensors (every adapter must have both factors)."""
    out: dict[str, torch.Tensor] = {}
    for factor, t in sorted(adapters.items()):
        for o in peft_outputs(arch, factor, tuple(t.shape)):
            if o.name in out:
                raise ValueError(f"PEFT tensor {o.name} comes from two adapter factors (one of them {factor}: "
                                 "a factor both shared by all experts and per expert)")
            buf = torch.empty(o.shape, dtype=t.dtype)
            region, piece = place(o, t, 0, 1, None, arch)
            buf[region] = piece
            out[o.name] = buf
    check_pairs(out)
    return out


def check_pairs(peft_names) -> None:
    """Every PEFT module has both lora_A and lora_B."""
    modules: dict[str, set] = {}
    for n in peft_names:
        module, _, ab = n.removesuffix(".weight").rpartition(".lora_")
        modules.setdefault(module, set()).add(ab)
    for module, abs_ in sorted(modules.items()):
        if abs_ != {"A", "B"}:
            raise ValueError(f"adapter of {module}: incomplete, has only lora_{''.join(sorted(abs_))} "
                             "(needs lora_A and lora_B)")
