"""GLM-4.5 MoE (Glm4MoeForCausalLM), the stand-in for DeepSeek-V3/Kimi-K2 routing: leading dense layers, a shared
expert, a router expert bias (e_score_correction_bias), optional q/k norm."""
from .tables import (ATTENTION_LINEARS, COMMON_PARAMS, DENSE_LINEARS, EXPERT_BIAS_PARAMS, EXPERT_LINEARS,
                     QK_NORM_PARAMS, SHARED_EXPERT_LINEARS, SHARED_EXPERT_PARAMS)
from .translate import Naming

NAMING = Naming("glm4_moe", COMMON_PARAMS + QK_NORM_PARAMS + EXPERT_BIAS_PARAMS + SHARED_EXPERT_PARAMS,
                ATTENTION_LINEARS + DENSE_LINEARS + SHARED_EXPERT_LINEARS + EXPERT_LINEARS)
