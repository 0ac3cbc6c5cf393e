"""Canonical adapter factors -> PEFT tensors (pure): which PEFT tensors a factor becomes, and where a slice of it
(a TP/ETP shard, or the whole factor) lands in each of them.

    A [r, in]                 copied to every HF module of a fused linear (q/k/v, gate/up share the A)
    B [out, r]                one HF module: as is
    B qkv [g*(q/g+2)*hd, r]   q/k/v interleaved per query group: split into q [nh*hd, r], k and v [nkv*hd, r]
    B glu [2, ffn, r]         gate = B[0], up = B[1]
    B qkv_gated               linear_qkv with the output gate, per query group [q heads, gate heads, k, v]: q_proj per
                              head [query, gate] (HF's order), k_proj, v_proj
    B gdn_in [kh, unit, r]    the delta-net's in_proj per key head [q, k, v x m, z x m, b x m, a x m]: Qwen3.5's
                              in_proj_qkv ([q; k; v]), in_proj_z, in_proj_b, in_proj_a, each over all heads
    B gdn_in_next             the same factor as Qwen3-Next's in_proj_qkvz ([q, k, v, z] per key head), in_proj_ba
    shared by all experts     the same factor for every expert's PEFT tensor

A shard of a factor maps to one contiguous block of every PEFT tensor it feeds (in_proj_qkv: one block in each of
q, k and v), so a sender can fill a bucket buffer shard by shard (refit/gather.py) and the whole-tensor export is the
same code with one shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lora.layers import delta_net_blocks
from ..models.arch import MoEArch
from ..models.naming import naming_for


@dataclass(frozen=True)
class PeftOut:
    name: str
    shape: tuple[int, ...]
    part: int                     # output part of the fused linear (q/k/v, gate/up), 0 when not split
    split: str                    # "copy" | "qkv" | "glu" | Linear.b_rows (qkv_gated, gdn_in, gdn_in_next)


def _split(name, ab: str) -> str:
    if ab == "A" or len(name.linear.hf) == 1:
        return "copy"
    return name.linear.b_rows or ("qkv" if name.linear.target == "qkv" else "glu")


def _gdn_sections(arch: MoEArch) -> list[int]:
    """Rows per key head of the delta-net's in_proj sections [q, k, v, z, b, a] (the adapter's FactorMeta.blocks)."""
    return list(delta_net_blocks(arch.linear_key_head_dim, arch.linear_value_head_dim, arch.linear_num_key_heads,
                                 arch.linear_num_value_heads))


def peft_outputs(arch: MoEArch, factor: str, global_shape: tuple[int, ...]) -> list[PeftOut]:
    """The PEFT tensors a canonical factor (global name and shape) becomes."""
    naming = naming_for(arch)
    name, ab = naming.parse_canonical(factor)
    split = _split(name, ab)
    r = global_shape[-1]
    out = []
    for peft, part in naming.peft_names(name, ab, arch.num_experts):
        if split == "copy":
            shape = tuple(global_shape)
        elif split == "glu":
            shape = tuple(global_shape[1:])
        elif split in ("qkv", "qkv_gated"):
            rows = (arch.num_heads * (2 if split == "qkv_gated" else 1) if part == 0 else arch.num_kv_heads)
            shape = (rows * arch.head_dim, r)
        else:
            sec, kh = _gdn_sections(arch), global_shape[0]
            groups = ([sec[:3], sec[3:4], sec[4:5], sec[5:]] if split == "gdn_in" else [sec[:4], sec[4:]])
            shape = (kh * sum(groups[part]), r)
        out.append(PeftOut(peft, shape, part, split))
    return out


def place(out: PeftOut, shard: torch.Tensor, index: int, count: int, shard_dim: int | None,
          arch: MoEArch) -> list[tuple[tuple[slice, ...], torch.Tensor]]:
    """[(region of the PEFT tensor, values)] for shard `index` of `count` of a canonical factor split on
    `shard_dim` (None: the whole factor): one block, or one per section (gdn_in's in_proj_qkv)."""
    if shard_dim is None:
        index = 0
    if out.split == "copy":
        if shard_dim is None:
            return [((slice(None),) * shard.dim(), shard)]
        n = shard.shape[shard_dim]
        region = [slice(None)] * shard.dim()
        region[shard_dim] = slice(index * n, (index + 1) * n)
        return [(tuple(region), shard)]
    r = shard.shape[-1]
    if out.split == "glu":                                   # canonical [2, ffn, r], sharded on dim 1
        pieces = [shard[out.part]]
    elif out.split == "qkv":
        qpg, hd = arch.num_heads // arch.num_kv_heads, arch.head_dim
        per = shard.reshape(-1, qpg + 2, hd, r)              # [groups in this shard, q/g + 2, hd, r]
        pieces = [per[:, :qpg] if out.part == 0 else per[:, qpg + out.part - 1]]
    elif out.split == "qkv_gated":                           # [groups, q heads + gate heads + k + v, hd, r]
        qpg, hd = arch.num_heads // arch.num_kv_heads, arch.head_dim
        per = shard.reshape(-1, 2 * qpg + 2, hd, r)
        pieces = [torch.stack([per[:, :qpg], per[:, qpg:2 * qpg]], dim=2) if out.part == 0
                  else per[:, 2 * qpg + out.part - 1]]
    else:                                                    # gdn_in / gdn_in_next: [key heads here, unit, r]
        sec = _gdn_sections(arch)
        secs = shard.split(sec, dim=1)
        if out.split == "gdn_in":
            pieces = list(secs[:3]) if out.part == 0 else [secs[2 + out.part]]
        else:
            pieces = [torch.cat(secs[:4], dim=1) if out.part == 0 else torch.cat(secs[4:], dim=1)]
    pieces = [p.reshape(-1, r) for p in pieces]
    whole = [p.shape[0] * (count if shard_dim is not None else 1) for p in pieces]   # each section's full rows
    places, start = [], 0
    for p, full in zip(pieces, whole):
        n = p.shape[0]
        places.append(((slice(start + index * n, start + (index + 1) * n), slice(None)), p))
        start += full
    return places


def to_peft_tensors(adapters: dict[str, torch.Tensor], arch: MoEArch) -> dict[str, torch.Tensor]:
    """Full canonical adapters -> PEFT tensors (every adapter must have both factors)."""
    out: dict[str, torch.Tensor] = {}
    for factor, t in sorted(adapters.items()):
        for o in peft_outputs(arch, factor, tuple(t.shape)):
            if o.name in out:
                raise ValueError(f"PEFT tensor {o.name} comes from two adapter factors (one of them {factor}: "
                                 "a factor both shared by all experts and per expert)")
            buf = torch.empty(o.shape, dtype=t.dtype)
            for region, piece in place(o, t, 0, 1, None, arch):
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
