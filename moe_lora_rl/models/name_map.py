"""HF <-> Megatron-core parameter names, one table for the Llama-style HF checkpoints of the supported families.

Each row maps a Megatron parameter (regex on the local name, with local layer {l} and local expert {e}) to the HF
tensors it is assembled from (templates with global layer {L} and global expert {E}) and to a shard kind that says
how the full tensor is built and split across ranks:

    replicated  same on every rank
    vocab       rows padded to a multiple of TP, then split on dim 0 (vocab-parallel)
    column      split on dim 0 (ColumnParallelLinear)
    row         split on dim 1 (RowParallelLinear)
    glu         [gate; up] column: each rank holds [gate_r; up_r]
    grouped_*   the same per local expert, transposed and concatenated (legacy GroupedMLP weight1/weight2)
    qkv         q/k/v interleaved per query group, then split on dim 0

Expert rows shard over the expert-tensor-parallel group and live on the EP rank that owns the expert.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    megatron: str
    hf: tuple[str, ...]
    kind: str
    expert: bool = False

    @property
    def pattern(self) -> re.Pattern:
        return re.compile("^" + self.megatron.replace(".", r"\.").replace("{l}", r"(?P<l>\d+)")
                          .replace("{e}", r"(?P<e>\d+)") + "$")


_A = "decoder.layers.{l}.self_attention."
_H = "model.layers.{L}."
ROWS: tuple[Row, ...] = (
    Row("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Row("output_layer.weight", ("lm_head.weight",), "vocab"),
    Row("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    Row("decoder.layers.{l}.input_layernorm.weight", (_H + "input_layernorm.weight",), "replicated"),
    Row("decoder.layers.{l}.pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), "replicated"),
    Row(_A + "linear_qkv.weight", tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Row(_A + "linear_qkv.bias", tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    Row(_A + "linear_proj.weight", (_H + "self_attn.o_proj.weight",), "row"),
    Row(_A + "q_layernorm.weight", (_H + "self_attn.q_norm.weight",), "replicated"),
    Row(_A + "k_layernorm.weight", (_H + "self_attn.k_norm.weight",), "replicated"),
    Row("decoder.layers.{l}.mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "glu"),
    Row("decoder.layers.{l}.mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "row"),
    Row("decoder.layers.{l}.mlp.router.weight", (_H + "mlp.gate.weight",), "replicated"),
    Row("decoder.layers.{l}.mlp.router.expert_bias", (_H + "mlp.gate.e_score_correction_bias",), "replicated"),
    Row("decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight",
        (_H + "mlp.experts.{E}.gate_proj.weight", _H + "mlp.experts.{E}.up_proj.weight"), "glu", expert=True),
    Row("decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc2.weight",
        (_H + "mlp.experts.{E}.down_proj.weight",), "row", expert=True),
    # legacy GroupedMLP: all local experts in one tensor, per expert [hidden, 2*ffn/etp] and [ffn/etp, hidden]
    Row("decoder.layers.{l}.mlp.experts.weight1",
        (_H + "mlp.experts.{E}.gate_proj.weight", _H + "mlp.experts.{E}.up_proj.weight"), "grouped_glu", expert=True),
    Row("decoder.layers.{l}.mlp.experts.weight2", (_H + "mlp.experts.{E}.down_proj.weight",), "grouped_row",
        expert=True),
    Row("decoder.layers.{l}.mlp.shared_experts.linear_fc1.weight",
        (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"), "glu"),
    Row("decoder.layers.{l}.mlp.shared_experts.linear_fc2.weight", (_H + "mlp.shared_experts.down_proj.weight",),
        "row"),
)
_COMPILED = [(r, r.pattern) for r in ROWS]


@dataclass(frozen=True)
class Resolved:
    row: Row
    hf_names: tuple[str, ...]
    global_layer: int | None
    global_expert: int | None


def resolve(megatron_name: str, layer_offset: int, expert_offset: int) -> Resolved:
    """HF sources for a local Megatron parameter name. Unknown names fail loudly (never silently skipped)."""
    for row, pat in _COMPILED:
        m = pat.match(megatron_name)
        if not m:
            continue
        gl = int(m["l"]) + layer_offset if "l" in m.groupdict() else None
        ge = int(m["e"]) + expert_offset if "e" in m.groupdict() else None
        names = tuple(h.replace("{L}", str(gl)).replace("{E}", str(ge) if ge is not None else "{E}") for h in row.hf)
        return Resolved(row, names, gl, ge)
    raise ValueError(f"no HF source known for Megatron parameter {megatron_name!r} (moe_lora_rl/models/name_map.py)")
