"""DeepSeek-V3 / Kimi-K2 / Moonlight (DeepseekV3ForCausalLM): Multi-head Latent Attention (MLA) on glm4_moe's routing
(leading dense layers, a shared expert, a router expert bias).

Contract (every name under model.layers.L.; Megatron under decoder.layers.l.; vLLM slices are output slices of the
module, counted from 0):

    target   HF module                    Megatron module                       vLLM module [slice]        q_lora_rank
    q_down   self_attn.q_a_proj           self_attention.linear_q_down_proj     self_attn.fused_qkv_a_proj [0]   set
    q_up     self_attn.q_b_proj           self_attention.linear_q_up_proj       self_attn.q_b_proj [0]           set
    q        self_attn.q_proj             self_attention.linear_q_proj          self_attn.q_proj [0]             null
    kv_down  self_attn.kv_a_proj_with_mqa self_attention.linear_kv_down_proj    self_attn.fused_qkv_a_proj [1]   set
                                                                                self_attn.kv_a_proj_with_mqa [0] null
    kv_up    self_attn.kv_b_proj          self_attention.linear_kv_up_proj      self_attn.kv_b_proj [0]          both
    proj     self_attn.o_proj             self_attention.linear_proj            self_attn.o_proj [0]             both

plus dense_fc1/2, shared_fc1/2, expert_fc1/2 as glm4_moe. (in, out) of each HF module: q_a_proj (hidden, q_lora_rank);
q_b_proj (q_lora_rank, heads*(qk_nope+qk_rope)); q_proj (hidden, heads*(qk_nope+qk_rope)); kv_a_proj_with_mqa
(hidden, kv_lora_rank+qk_rope); kv_b_proj (kv_lora_rank, heads*(qk_nope+v_head)); o_proj (heads*v_head, hidden).
vLLM's decode never calls kv_b_proj: it multiplies by W_UK_T / W_UV derived from kv_b_proj's weight at load.

Norms (not adaptable): q_a_layernorm -> self_attention.q_layernorm (local spec) or
self_attention.linear_q_up_proj.layer_norm_weight (TE spec), kv_a_layernorm -> kv_layernorm or
linear_kv_up_proj.layer_norm_weight. The down projections are column-parallel (rows split over TP, output gathered) or
whole (duplicated: both in the TE spec, linear_kv_down_proj in our local spec too): shard kind "down". MTP layers
(num_nextn_predict_layers, tensors model.layers.{num_hidden_layers + i}.*) have no row here: see offsets.split_mtp.

`naming(q_lora_rank)` picks the variant; NAMING is DeepSeek-V3's / Kimi-K2's (q_lora_rank set).
"""
from __future__ import annotations

from .tables import (COMMON_PARAMS, DENSE_LINEARS, EXPERT_BIAS_PARAMS, EXPERT_LINEARS, HF_LAYER, MEGATRON_LAYER,
                     SHARED_EXPERT_LINEARS, SHARED_EXPERT_PARAMS, Linear, ParamRow)
from .translate import Naming

_ATT = MEGATRON_LAYER + "self_attention."


def _hf(p: str) -> tuple[str, ...]:
    return (HF_LAYER + "self_attn." + p,)


Q_DOWN = Linear("q_down", "attention", "self_attention.linear_q_down_proj", ("self_attn.q_a_proj",),
                "self_attn.fused_qkv_a_proj", "column", ("hidden", "q_rank"), vllm_slice=0)
Q_UP = Linear("q_up", "attention", "self_attention.linear_q_up_proj", ("self_attn.q_b_proj",), "self_attn.q_b_proj",
              "column", ("q_rank", "q_heads"))
Q = Linear("q", "attention", "self_attention.linear_q_proj", ("self_attn.q_proj",), "self_attn.q_proj", "column",
           ("hidden", "q_heads"))
KV_DOWN_FUSED = Linear("kv_down", "attention", "self_attention.linear_kv_down_proj", ("self_attn.kv_a_proj_with_mqa",),
                       "self_attn.fused_qkv_a_proj", "column", ("hidden", "kv_a"), vllm_slice=1)
KV_DOWN = Linear("kv_down", "attention", "self_attention.linear_kv_down_proj", ("self_attn.kv_a_proj_with_mqa",),
                 "self_attn.kv_a_proj_with_mqa", "column", ("hidden", "kv_a"))
KV_UP = Linear("kv_up", "attention", "self_attention.linear_kv_up_proj", ("self_attn.kv_b_proj",),
               "self_attn.kv_b_proj", "column", ("kv_rank", "kv_heads"))
PROJ = Linear("proj", "attention", "self_attention.linear_proj", ("self_attn.o_proj",), "self_attn.o_proj", "row",
              ("q", "hidden"))

MLA_COMMON_PARAMS = tuple(r for r in COMMON_PARAMS if ".linear_qkv." not in r.megatron) + (
    ParamRow(_ATT + "linear_kv_down_proj.weight", _hf("kv_a_proj_with_mqa.weight"), "down"),
    ParamRow(_ATT + "linear_kv_up_proj.weight", _hf("kv_b_proj.weight"), "column"),
    ParamRow(_ATT + "kv_layernorm.weight", _hf("kv_a_layernorm.weight"), "replicated"),
    ParamRow(_ATT + "linear_kv_up_proj.layer_norm_weight", _hf("kv_a_layernorm.weight"), "replicated"),
)
Q_LORA_PARAMS = (
    ParamRow(_ATT + "linear_q_down_proj.weight", _hf("q_a_proj.weight"), "down"),
    ParamRow(_ATT + "linear_q_up_proj.weight", _hf("q_b_proj.weight"), "column"),
    ParamRow(_ATT + "q_layernorm.weight", _hf("q_a_layernorm.weight"), "replicated"),
    ParamRow(_ATT + "linear_q_up_proj.layer_norm_weight", _hf("q_a_layernorm.weight"), "replicated"),
)
Q_PROJ_PARAMS = (ParamRow(_ATT + "linear_q_proj.weight", _hf("q_proj.weight"), "column"),)
_ROUTING_PARAMS = EXPERT_BIAS_PARAMS + SHARED_EXPERT_PARAMS
_MLP = DENSE_LINEARS + SHARED_EXPERT_LINEARS + EXPERT_LINEARS

NAMING = Naming("deepseek_v3", MLA_COMMON_PARAMS + Q_LORA_PARAMS + _ROUTING_PARAMS,
                (Q_DOWN, Q_UP, KV_DOWN_FUSED, KV_UP, PROJ) + _MLP)
NAMING_Q_PROJ = Naming("deepseek_v3", MLA_COMMON_PARAMS + Q_PROJ_PARAMS + _ROUTING_PARAMS,
                       (Q, KV_DOWN, KV_UP, PROJ) + _MLP)
# the MLA linears by Megatron module, for the family-free Megatron naming (naming.MEGATRON)
MEGATRON_LINEARS = (Q_DOWN, Q_UP, Q, KV_DOWN_FUSED, KV_UP)


def naming(q_lora_rank: int | None) -> Naming:
    """The naming of a DeepseekV3ForCausalLM with this q_lora_rank (None: q is one projection, as Moonlight)."""
    return NAMING if q_lora_rank is not None else NAMING_Q_PROJ
