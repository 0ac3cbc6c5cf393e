"""vLLM CPU MoE weight reload fix.

UnquantizedFusedMoEMethod._setup_kernel runs the CPU experts' prepack (fused_experts.process_weights_after_loading)
only on the first load; a later reload_weights leaves the CPU kernel reading unpacked weights and the outputs are
wrong. The wrapper repeats the prepack on weight updates. Applied by apply() on the worker extension's first
moe_lora_* call (never by the plugin's register()), checked against the vLLM version, undone by restore().
"""
from __future__ import annotations

import functools

from .compat import check_vllm_version

_ORIG = None


def apply() -> bool:
    """Returns True when the fix is active (CPU platform, supported vLLM), False when not needed. ValueError on a
    vLLM version the fix was not written for, before anything is changed."""
    global _ORIG
    check_vllm_version("the CPU MoE reload fix (UnquantizedFusedMoEMethod._setup_kernel)")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m

    if _ORIG is not None:
        return True
    cls = m.UnquantizedFusedMoEMethod
    _ORIG = cls._setup_kernel

    @functools.wraps(_ORIG)
    def _setup_kernel(self, layer, w13, w2):
        is_update = self.moe_kernel is not None
        _ORIG(self, layer, w13, w2)
        if is_update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    cls._setup_kernel = _setup_kernel
    return True


def restore() -> None:
    global _ORIG
    if _ORIG is None:
        return
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m

    m.UnquantizedFusedMoEMethod._setup_kernel = _ORIG
    _ORIG = None
