"""vLLM CPU plain-RoPE fix for Multi-head Latent Attention (DeepSeek-V3 / Kimi-K2 / Moonlight checkpoints).

vLLM 0.32's MLA layer (model_executor/layers/mla.py) rotates `q[..., qk_nope_head_dim:]`, a 3-D non-contiguous view
[tokens, heads, rope], and `k_pe`, a 3-D view of the latent projection's output. On CPU, `RotaryEmbedding.forward_cpu`
hands them to the C++ rotary kernel, which reads them as [tokens, heads * head_size] with the token stride: position 0
is right and every later position wrong (greedy tokens differ from HF's, prompt logprobs off by up to 8 on a tiny
model). Yarn (DeepseekScalingRotaryEmbedding) has no CPU kernel and is unaffected. The fix routes those calls (either
tensor 3-D or non-contiguous) of the MLA layers' rotary modules to vLLM's own `forward_native`; 2-D contiguous calls
keep the kernel.

Per instance, on a loaded model (CustomOp binds `_forward_method` at construction, so a class patch after load would
reach nothing): apply(model) by the worker extension on its first moe_lora_* call (make_engine makes that call when
it builds an engine), CPU platform only, checked against the vLLM version; restore(model) undoes it.
"""
from __future__ import annotations

from .compat import check_vllm_version


def _needs_native(query, key) -> bool:
    return any(t is not None and (t.dim() != 2 or not t.is_contiguous()) for t in (query, key))


def _routed(rope):
    kernel = rope._forward_method

    def forward(positions, query, key=None):
        if _needs_native(query, key):
            return rope.forward_native(positions, query, key)
        return kernel(positions, query, key)

    forward.moe_lora_kernel = kernel
    return forward


def mla_rotary_modules(model) -> list:
    """The rotary modules of the model's MLA layers that dispatch to vLLM's CPU rotary kernel (plain RoPE)."""
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    out, seen = [], set()
    for mod in model.modules():
        rope = getattr(mod, "rotary_emb", None) if isinstance(mod, MultiHeadLatentAttentionWrapper) else None
        fm = getattr(rope, "_forward_method", None)
        if rope is not None and (getattr(fm, "__func__", None) is RotaryEmbedding.forward_cpu
                                 or hasattr(fm, "moe_lora_kernel")) and id(rope) not in seen:
            seen.add(id(rope))
            out.append(rope)
    return out


def apply(model) -> int:
    """Route the MLA layers' non-2-D / non-contiguous rotary calls to forward_native; returns how many rotary modules
    are routed (0: not the CPU platform, no MLA layer, or yarn). ValueError on a vLLM version the fix was not written
    for, before anything is changed. Idempotent."""
    check_vllm_version("the CPU MLA plain-RoPE fix (RotaryEmbedding.forward_cpu on MLA layers)")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    ropes = mla_rotary_modules(model)
    for rope in ropes:
        if not hasattr(rope._forward_method, "moe_lora_kernel"):
            rope._forward_method = _routed(rope)
    return len(ropes)


def restore(model) -> None:
    for rope in mla_rotary_modules(model):
        kernel = getattr(rope._forward_method, "moe_lora_kernel", None)
        if kernel is not None:
            rope._forward_method = kernel
