"""Qwen3.5/3.6-MoE (Qwen3_5MoeForCausalLM, and the text tower of Qwen3_5MoeForConditionalGeneration) and Qwen3-Next
(Qwen3NextForCausalLM): hybrid linear attention, every layer MoE with a gated shared expert (models/hybrid.py reads
the config).

Contract (every name under model.layers.L.; Megatron under decoder.layers.l.; vLLM slices are output slices):

    target      HF module(s)                         Megatron module            vLLM module [slice]        layers
    linear_in   linear_attn.in_proj_qkv, _z, _b, _a  self_attention.in_proj     linear_attn.in_proj_qkvz [0, 1]  linear
                                                     (q|k|v|z|b|a per TP rank)  linear_attn.in_proj_ba [0, 1]
    linear_out  linear_attn.out_proj                 self_attention.out_proj    linear_attn.out_proj [0]         linear
    qkv         self_attn.q_proj (query and gate),   self_attention.linear_qkv  self_attn.qkv_proj [0, 1, 2]     full
                k_proj, v_proj                       (per group: q|gate|k|v)
    proj        self_attn.o_proj                     self_attention.linear_proj self_attn.o_proj [0]             full
    shared_fc1  mlp.shared_expert.gate_proj, up_proj mlp.shared_experts.linear_fc1  mlp.shared_expert.gate_up_proj
    shared_fc2  mlp.shared_expert.down_proj          mlp.shared_experts.linear_fc2  mlp.shared_expert.down_proj
    dense_fc1/2, expert_fc1/2 as qwen3_moe (per-expert tensors in the checkpoint; transformers fuses them in memory)

LoRA B rows (canonical, the same at every TP degree; refit/rename.py splits them into the HF parts): qkv as Megatron's
linear_qkv (per query group [its query heads, their gate heads, k, v]); linear_in per key head [q, k, v x r, z x r,
b x r, a x r] (r = value heads per key head), a [key heads, rows per key head, rank] factor whose TP shard is the
rank's key heads (lora/layers.py reorders them to in_proj's per-rank [q|k|v|z|b|a] in the forward).

Qwen3-Next stores the delta-net's inputs fused per key head (in_proj_qkvz: per key head [q, k, v x r, z x r], r = value
heads per key head; in_proj_ba: [b x r, a x r]): `naming(fused_linear_proj=True)`, whose rows read those two tensors
(shard kinds gdn_in_next). Non-adaptable: conv1d (depthwise over q|k|v), A_log, dt_bias, the gated norm (x * w), q/k
norms and the layer norms (x * (1 + w): shard kind plus_one), the router, the shared expert's gate
(mlp.shared_experts.gate_weight). Megatron's local spec keeps input_layernorm; the TE spec fuses it into in_proj /
linear_qkv (layer_norm_weight). MTP tensors (mtp.*) and a vision tower (model.visual.*) have no row: the checkpoint
reader sets them aside (models/checkpoint.py).
"""
from __future__ import annotations

from .tables import (DENSE_LINEARS, DENSE_MLP_PARAMS, EXPERT_LINEARS, EXPERT_PARAMS, HF_LAYER, MEGATRON_LAYER, Linear,
                     ParamRow)
from .translate import Naming

_ATT = MEGATRON_LAYER + "self_attention."
_LIN = "linear_attn."


def _hf(p: str) -> str:
    return HF_LAYER + p


def _norm(megatron: str, hf: str) -> ParamRow:
    return ParamRow(megatron, (_hf(hf),), "plus_one")


_IN_PARTS = tuple(_LIN + f"in_proj_{p}" for p in ("qkv", "z", "b", "a"))
LINEAR_IN = Linear("linear_in", "linear_attention", "self_attention.in_proj", _IN_PARTS, _LIN + "in_proj_qkvz",
                   "column", ("hidden", "lin_qkv|lin_v|lin_heads|lin_heads"),
                   vllm_parts=((_LIN + "in_proj_qkvz", 0), (_LIN + "in_proj_qkvz", 1), (_LIN + "in_proj_ba", 0),
                               (_LIN + "in_proj_ba", 1)), b_rows="gdn_in")
LINEAR_OUT = Linear("linear_out", "linear_attention", "self_attention.out_proj", (_LIN + "out_proj",),
                    _LIN + "out_proj", "row", ("lin_v", "hidden"))
GATED_QKV = Linear("qkv", "attention", "self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj",
                   "self_attn.v_proj"), "self_attn.qkv_proj", "column", ("hidden", "q_gate|kv|kv"),
                   b_rows="qkv_gated")
PROJ = Linear("proj", "attention", "self_attention.linear_proj", ("self_attn.o_proj",), "self_attn.o_proj", "row",
              ("q", "hidden"))
SHARED_FC1 = Linear("shared_fc1", "shared", "mlp.shared_experts.linear_fc1",
                    ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), "mlp.shared_expert.gate_up_proj",
                    "column", ("hidden", "shared_ffn"))
SHARED_FC2 = Linear("shared_fc2", "shared", "mlp.shared_experts.linear_fc2", ("mlp.shared_expert.down_proj",),
                    "mlp.shared_expert.down_proj", "row", ("shared_ffn", "hidden"))
LINEARS = (LINEAR_IN, LINEAR_OUT, GATED_QKV, PROJ, SHARED_FC1, SHARED_FC2) + DENSE_LINEARS + EXPERT_LINEARS

_BASE = (
    ParamRow("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    ParamRow("output_layer.weight", ("lm_head.weight",), "vocab"),
    ParamRow("decoder.final_layernorm.weight", ("model.norm.weight",), "plus_one"),
    _norm(MEGATRON_LAYER + "input_layernorm.weight", "input_layernorm.weight"),
    _norm(_ATT + "in_proj.layer_norm_weight", "input_layernorm.weight"),
    _norm(_ATT + "linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    _norm(MEGATRON_LAYER + "pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    # gated attention (full layers)
    ParamRow(_ATT + "linear_qkv.weight", tuple(_hf(f"self_attn.{p}_proj.weight") for p in "qkv"), "qkv_gated"),
    ParamRow(_ATT + "linear_proj.weight", (_hf("self_attn.o_proj.weight"),), "row"),
    _norm(_ATT + "q_layernorm.weight", "self_attn.q_norm.weight"),
    _norm(_ATT + "k_layernorm.weight", "self_attn.k_norm.weight"),
    # Gated DeltaNet (linear layers)
    ParamRow(_ATT + "conv1d.weight", (_hf(_LIN + "conv1d.weight"),), "gdn_conv"),
    ParamRow(_ATT + "A_log", (_hf(_LIN + "A_log"),), "column"),
    ParamRow(_ATT + "dt_bias", (_hf(_LIN + "dt_bias"),), "column"),
    ParamRow(_ATT + "out_norm.weight", (_hf(_LIN + "norm.weight"),), "replicated"),
    ParamRow(_ATT + "out_proj.weight", (_hf(_LIN + "out_proj.weight"),), "row"),
    # dense layers (Qwen3-Next's mlp_only_layers)
    *DENSE_MLP_PARAMS,
    # MoE: router, routed experts (per expert in the checkpoint), the gated shared expert
    ParamRow(MEGATRON_LAYER + "mlp.router.weight", (_hf("mlp.gate.weight"),), "replicated"),
    *EXPERT_PARAMS,
    ParamRow(MEGATRON_LAYER + "mlp.shared_experts.linear_fc1.weight",
             (_hf("mlp.shared_expert.gate_proj.weight"), _hf("mlp.shared_expert.up_proj.weight")), "glu"),
    ParamRow(MEGATRON_LAYER + "mlp.shared_experts.linear_fc2.weight", (_hf("mlp.shared_expert.down_proj.weight"),),
             "row"),
    ParamRow(MEGATRON_LAYER + "mlp.shared_experts.gate_weight", (_hf("mlp.shared_expert_gate.weight"),),
             "replicated"),
)
_IN_PROJ = ParamRow(_ATT + "in_proj.weight", tuple(_hf(p + ".weight") for p in _IN_PARTS), "gdn_in")
_IN_PROJ_NEXT = ParamRow(_ATT + "in_proj.weight", (_hf(_LIN + "in_proj_qkvz.weight"), _hf(_LIN + "in_proj_ba.weight")),
                         "gdn_in_next")
LINEAR_IN_NEXT = Linear("linear_in", "linear_attention", "self_attention.in_proj",
                        (_LIN + "in_proj_qkvz", _LIN + "in_proj_ba"), _LIN + "in_proj_qkvz", "column",
                        ("hidden", "lin_qkvz|lin_ba"),
                        vllm_parts=((_LIN + "in_proj_qkvz", 0), (_LIN + "in_proj_ba", 0)), b_rows="gdn_in_next")

# peft 0.19 converts per-expert targets for the model types transformers maps onto qwen2_moe (qwen3_next among them)
# but not qwen3_5_moe_text, whose fused experts PEFT then never targets: the export names them (refit/export.py)
NAMING = Naming("qwen3_5_moe", _BASE + (_IN_PROJ,), LINEARS, peft_fused_experts=True)
NAMING_NEXT = Naming("qwen3_next", _BASE + (_IN_PROJ_NEXT,), (LINEAR_IN_NEXT,) + LINEARS[1:])
# the delta-net linears by Megatron module, for the family-free Megatron naming (naming.MEGATRON)
MEGATRON_LINEARS = (LINEAR_IN, LINEAR_OUT)


def naming(fused_linear_proj: bool) -> Naming:
    """Qwen3.5's naming, or Qwen3-Next's (its delta-net inputs fused per key head)."""
    return NAMING_NEXT if fused_linear_proj else NAMING
