"""Per model family, one naming module (HF, Megatron, canonical adapter, PEFT and vLLM names; offsets), chosen from
one table. Adding a family: a module here building its `Naming`, and a row below (and its config reader in
models/arch.py)."""
from __future__ import annotations

from . import glm4_moe, qwen3_moe
from .base import AdapterName, Linear, Naming, Offsets, ParamRow, Resolved, VllmName, owner

FAMILIES: dict[str, Naming] = {
    "qwen3_moe": qwen3_moe.NAMING,
    "glm4_moe": glm4_moe.NAMING,
}


def naming_for(arch_or_family) -> Naming:
    """The naming of a family, by name or by an architecture (models.arch.MoEArch)."""
    family = getattr(arch_or_family, "family", arch_or_family)
    if family not in FAMILIES:
        raise ValueError(f"no naming module for model family {family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[family]


# Megatron module names come from our builder and are the same for every family: family-free callers (LoRA
# planning on a Megatron model that does not carry its HF family) use this one.
MEGATRON = glm4_moe.NAMING

__all__ = ["FAMILIES", "naming_for", "MEGATRON", "Naming", "Offsets", "AdapterName", "Linear", "ParamRow",
           "Resolved", "VllmName", "owner"]
