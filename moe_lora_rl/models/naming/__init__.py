"""Per model family, one naming module (HF, Megatron, canonical adapter, PEFT and vLLM names; offsets), chosen from
one table; every family builds its `Naming` (translate.py) from the shared rows of tables.py, with the layer / expert
offsets of offsets.py. Adding a family: a module here building its `Naming`, and a row below (and its config reader in
models/arch.py). A family whose names depend on the architecture (deepseek_v3: q_lora_rank set or null) has a row in
BY_ARCH as well; `naming_for(family)` then gives its default variant."""
from __future__ import annotations

from typing import Callable

from . import deepseek_v3, glm4_moe, qwen3_5_moe, qwen3_moe
from .offsets import Offsets, layer_of, owner, split_mtp
from .tables import (ATTENTION_LINEARS, COMMON_PARAMS, DENSE_LINEARS, EXPERT_BIAS_PARAMS, EXPERT_LINEARS, QK_NORM_PARAMS,
                     SHARED_EXPERT_LINEARS, SHARED_EXPERT_PARAMS, Linear, ParamRow)
from .translate import AdapterName, Naming, Resolved, VllmName

FAMILIES: dict[str, Naming] = {
    "qwen3_moe": qwen3_moe.NAMING,
    "glm4_moe": glm4_moe.NAMING,
    "deepseek_v3": deepseek_v3.NAMING,          # q_lora_rank set (DeepSeek-V3, Kimi-K2)
    "qwen3_5_moe": qwen3_5_moe.NAMING,          # Qwen3.5/3.6-MoE: hybrid linear attention
    "qwen3_next": qwen3_5_moe.NAMING_NEXT,      # its sibling, the delta-net's inputs fused per key head
}
BY_ARCH: dict[str, Callable[[object], Naming]] = {
    "deepseek_v3": lambda arch: deepseek_v3.naming(arch.q_lora_rank),
}


def naming_for(arch_or_family) -> Naming:
    """The naming of a family, by an architecture (models.arch.MoEArch: the variant it needs) or by name (the
    family's default variant, for callers without an architecture)."""
    family = getattr(arch_or_family, "family", arch_or_family)
    if family not in FAMILIES:
        raise ValueError(f"no naming module for model family {family!r}; known: {sorted(FAMILIES)}")
    if family in BY_ARCH and not isinstance(arch_or_family, str):
        return BY_ARCH[family](arch_or_family)
    return FAMILIES[family]


# Megatron module names come from our builder and are the same for every family: family-free callers (LoRA
# planning on a Megatron model that does not carry its HF family) use this one. It holds every linear any family
# has (GQA's linear_qkv, MLA's down/up projections, the delta-net's in/out projections); its HF/vLLM names are not
# for use.
MEGATRON = Naming("megatron", COMMON_PARAMS + QK_NORM_PARAMS + EXPERT_BIAS_PARAMS + SHARED_EXPERT_PARAMS,
                  ATTENTION_LINEARS + deepseek_v3.MEGATRON_LINEARS + qwen3_5_moe.MEGATRON_LINEARS + DENSE_LINEARS + SHARED_EXPERT_LINEARS
                  + EXPERT_LINEARS)

__all__ = ["FAMILIES", "BY_ARCH", "naming_for", "MEGATRON", "Naming", "Offsets", "AdapterName", "Linear", "ParamRow",
           "Resolved", "VllmName", "layer_of", "owner", "split_mtp"]
