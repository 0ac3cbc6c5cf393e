"""Load an HF safetensors checkpoint into this rank's shard of a megatron-core model.

plan (pure, per parameter: HF sources + shard kind + group rank/size) -> read HF tensors -> assemble -> slice -> copy.
Every local parameter must be resolved and shape-checked; nothing is skipped silently. The only checkpoint tensors no
parameter reads are an MTP layer's (DeepSeek-V3's model.layers.{num_hidden_layers}.*): counted, never mapped.

Shard kinds: replicated, vocab (rows, padded), column (rows), row (columns), glu (gate and up rows each), qkv (per
query group), down (MLA's down projections: rows in the local spec, whole in the TE spec, told apart by the shard's
shape), grouped_glu / grouped_row (legacy GroupedMLP); the hybrid family's plus_one, qkv_gated, gdn_in, gdn_in_next,
gdn_conv (hf_load_hybrid.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.arch import MoEArch
from ..models.checkpoint import HFCheckpoint
from ..models.naming import Offsets, Resolved, naming_for
from . import hf_load_hybrid as hybrid_kinds


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    size: int


def assemble(kind: str, parts: list[torch.Tensor], arch: MoEArch, shard: ShardSpec, padded_vocab: int):
    """Full HF tensors -> this rank's Megatron shard."""
    r, n = shard.rank, shard.size
    if kind == "replicated":
        return parts[0]
    if kind == "vocab":
        w = parts[0]
        if padded_vocab > w.shape[0]:
            w = torch.cat([w, w.new_zeros(padded_vocab - w.shape[0], *w.shape[1:])])
        return w.chunk(n, dim=0)[r]
    if kind == "column":
        return parts[0].chunk(n, dim=0)[r]
    if kind in ("down_column", "down_whole"):
        return parts[0] if kind == "down_whole" else parts[0].chunk(n, dim=0)[r]
    if kind == "row":
        return parts[0].chunk(n, dim=1)[r]
    if kind == "glu":
        gate, up = parts
        return torch.cat([gate.chunk(n, dim=0)[r], up.chunk(n, dim=0)[r]], dim=0)
    if kind in hybrid_kinds.KINDS:
        return hybrid_kinds.assemble(kind, parts, arch, r, n)
    if kind == "qkv":
        q, k, v = parts
        g, hd = arch.num_kv_heads, arch.head_dim
        tail = q.shape[1:]
        full = torch.cat([q.reshape(g, -1, hd, *tail), k.reshape(g, 1, hd, *tail), v.reshape(g, 1, hd, *tail)], 1)
        return full.reshape(-1, *tail).chunk(n, dim=0)[r]
    raise AssertionError(f"unknown shard kind {kind!r}")


def offsets(model) -> Offsets:
    """This rank's local -> global layer and expert numbering (the one place that reads it from a model)."""
    from megatron.core import parallel_state as ps

    layers = getattr(model.decoder, "layers", [])
    first = layers[0].layer_number - 1 if len(layers) else 0
    return Offsets.for_rank(first, ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                            model.config.num_moe_experts or 0)


def local_tensors(model) -> dict[str, torch.Tensor]:
    """Parameters plus the persistent routing buffers (expert bias) that come from the checkpoint."""
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n.endswith("router.expert_bias")})
    return out


def plan(model, arch: MoEArch) -> dict[str, Resolved]:
    names, off = naming_for(arch), offsets(model)
    return {name: names.resolve(name, off) for name in local_tensors(model)}


def mtp_count(ckpt_dir: str | Path, arch: MoEArch) -> int:
    """Tensors of the checkpoint's MTP layers (DeepSeek-V3's num_nextn_predict_layers), which no parameter reads."""
    from ..models.naming import split_mtp

    return len(split_mtp(HFCheckpoint(ckpt_dir).weight_map, arch.num_layers)[1])


def load_hf_weights(model, ckpt_dir: str | Path, arch: MoEArch) -> int:
    """Copy the checkpoint into the local model shard; returns the number of tensors loaded. An MTP layer's tensors
    (mtp_count) are skipped: its layer number is past the backbone's, and no Megatron parameter resolves to it."""
    from megatron.core import parallel_state as ps

    ckpt = HFCheckpoint(ckpt_dir)
    tp = ShardSpec(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = ShardSpec(ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    vocab = model.vocab_size
    tensors = local_tensors(model)
    expert_offset = offsets(model).expert
    num_local = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size() \
        if model.config.num_moe_experts else 0
    for name, res in plan(model, arch).items():
        grouped = res.row.kind.startswith("grouped_")
        experts = range(expert_offset, expert_offset + num_local) if grouped else [None]
        shards = []
        for e in experts:
            names = [h.replace("{E}", str(e)) for h in res.hf_names] if grouped else list(res.hf_names)
            missing = [h for h in names if h not in ckpt]
            if missing:
                raise ValueError(f"checkpoint {ckpt_dir} lacks {missing} needed for Megatron parameter {name!r}")
            parts = [ckpt.get(h).to(torch.float32) for h in names]
            kind = {"grouped_glu": "glu", "grouped_row": "row"}.get(res.row.kind, res.row.kind)
            if kind == "down":
                kind = "down_whole" if tensors[name].shape[0] == parts[0].shape[0] else "down_column"
            shards.append(assemble(kind, parts, arch, etp if res.row.expert else tp, vocab))
        # GroupedMLP reads weight1 [hidden, E*2ffn/etp] as .view(E, hidden, -1) and weight2 [E*ffn/etp, hidden] as
        # .view(E, -1, hidden): memory holds the per-expert transposed matrices one after another.
        value = torch.stack([s.t() for s in shards]).reshape(tensors[name].shape) if grouped else shards[0]
        target = tensors[name]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name}: checkpoint gives shape {tuple(value.shape)} from {res.hf_names}, the model "
                             f"shard expects {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
    return len(tensors)
