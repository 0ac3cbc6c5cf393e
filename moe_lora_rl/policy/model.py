"""One entry point from an HF checkpoint to this rank's Megatron model stage (the policy, the benches and the tests
all build through it):

    init_distributed(layout, rc)                              # the caller's job, once
    arch, model = build_from_hf(path, layout, rc, lora=LoRAConfig(rank=8, alpha=16))
"""
from __future__ import annotations

from pathlib import Path

from ..lora.config import LoRAConfig
from ..megatron.build import build_model
from ..models.arch import load_arch
from ..megatron.layout import Layout
from ..megatron.hf_load import load_hf_weights
from ..megatron.run_config import RunConfig


def build_from_hf(path: str | Path, layout: Layout, rc: RunConfig | None = None, *, lora: LoRAConfig | None = None,
                  grouped_experts: bool = False, transformer_overrides=None, **config_overrides):
    """(arch, model): the checkpoint's architecture, and this rank's GPTModel stage with the HF weights loaded and,
    if `lora` is given, adapters applied (base frozen). Parallel state must be initialised for `layout`.
    transformer_overrides: megatron.transformer_options' kwargs (activation recompute), checked by build_model."""
    from ..lora import apply_lora

    path = str(path)
    if not Path(path, "config.json").is_file():
        raise ValueError(f"model path {path!r} has no config.json (not an HF checkpoint directory)")
    arch = load_arch(path)
    model = build_model(arch, layout, rc, grouped_experts=grouped_experts,
                        transformer_overrides=transformer_overrides, **config_overrides)
    load_hf_weights(model, path, arch)
    if lora is not None:
        apply_lora(model, lora)
    return arch, model
