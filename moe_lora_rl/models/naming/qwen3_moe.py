"""Qwen3-MoE (Qwen3MoeForCausalLM): every layer MoE unless listed dense, q/k norm, no shared expert."""
from .tables import ATTENTION_LINEARS, COMMON_PARAMS, DENSE_LINEARS, EXPERT_LINEARS, QK_NORM_PARAMS
from .translate import Naming

NAMING = Naming("qwen3_moe", COMMON_PARAMS + QK_NORM_PARAMS, ATTENTION_LINEARS + DENSE_LINEARS + EXPERT_LINEARS)
