"""The hybrid family's shard kinds (pure): full HF tensors -> this TP rank's Megatron shard (megatron/hf_load.py's assemble
hands these kinds here). Naming rows: models/naming/qwen3_5_moe.py.

    plus_one     replicated, 1 + w: HF's RMSNorms compute x * (1 + w), megatron's local RMSNorm x * w
    qkv_gated    q_proj (per head [query (head_dim), gate (head_dim)]), k_proj, v_proj -> linear_qkv with
                 attention_output_gate, per query group [its query heads, its gate heads, k, v], split over TP
    gdn_in       in_proj_qkv ([q; k; v]), in_proj_z, in_proj_b, in_proj_a -> GatedDeltaNet.in_proj, per TP rank
                 [q_r, k_r, v_r, z_r, b_r, a_r]: each section split evenly over TP (key heads for q/k, value heads
                 for v/z/b/a; a rank's value heads are those of its key heads, as repeat_interleave pairs them)
    gdn_in_next  Qwen3-Next's in_proj_qkvz (per key head [q, k, v x r, z x r]) and in_proj_ba (per key head
                 [b x r, a x r]), r = value heads per key head, unfused to gdn_in's parts first
    gdn_conv     conv1d.weight [q|k|v channels, 1, K]: each section split over TP
"""
from __future__ import annotations

import torch

KINDS = ("plus_one", "qkv_gated", "gdn_in", "gdn_in_next", "gdn_conv")


def _split(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    assert t.shape[0] % size == 0, f"tp: {t.shape[0]} rows do not split over {size} ranks"
    return t.chunk(size, dim=0)[rank]


def _qkv_sections(arch) -> list[int]:
    k = arch.linear_num_key_heads * arch.linear_key_head_dim
    return [k, k, arch.linear_num_value_heads * arch.linear_value_head_dim]


def unfuse_next(qkvz: torch.Tensor, ba: torch.Tensor, arch) -> list[torch.Tensor]:
    """Qwen3-Next's fused in_proj_qkvz / in_proj_ba -> Qwen3.5's [in_proj_qkv, in_proj_z, in_proj_b, in_proj_a]
    (transformers' qwen3_next fix_query_key_value_ordering, on the weights' rows)."""
    kh, kd, vd = arch.linear_num_key_heads, arch.linear_key_head_dim, arch.linear_value_head_dim
    r = arch.linear_num_value_heads // kh
    tail = qkvz.shape[1:]
    q, k, v, z = qkvz.reshape(kh, 2 * kd + 2 * r * vd, *tail).split([kd, kd, r * vd, r * vd], dim=1)
    b, a = ba.reshape(kh, 2 * r, *tail).split([r, r], dim=1)
    flat = [x.reshape(-1, *tail) for x in (q, k, v, z, b, a)]
    return [torch.cat(flat[:3]), *flat[3:]]


def assemble(kind: str, parts: list[torch.Tensor], arch, rank: int, size: int) -> torch.Tensor:
    if kind == "plus_one":
        return parts[0] + 1.0
    if kind == "qkv_gated":
        q, k, v = parts
        g, hd, nh = arch.num_kv_heads, arch.head_dim, arch.num_heads
        tail = q.shape[1:]
        qg = q.reshape(nh, 2, hd, *tail)
        per_group = [qg[:, 0].reshape(g, -1, *tail), qg[:, 1].reshape(g, -1, *tail),
                     k.reshape(g, hd, *tail), v.reshape(g, hd, *tail)]
        return _split(torch.cat(per_group, dim=1).reshape(-1, *tail), rank, size)
    if kind == "gdn_in_next":
        kind, parts = "gdn_in", unfuse_next(*parts, arch)
    if kind == "gdn_in":
        qkv, z, b, a = parts
        sections = [*qkv.split(_qkv_sections(arch)), z, b, a]
        return torch.cat([_split(s, rank, size) for s in sections])
    if kind == "gdn_conv":
        return torch.cat([_split(s, rank, size) for s in parts[0].split(_qkv_sections(arch))])
    raise AssertionError(f"unknown hybrid shard kind {kind!r}")
