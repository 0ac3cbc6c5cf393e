"""LoRA on MLA's kv_b_proj, served by merging (DeepSeek-V3 / Kimi-K2 / Moonlight).

vLLM's MLA decode never calls kv_b_proj: it multiplies by W_UK_T / W_UV, derived from kv_b_proj.weight by the
attention layer's process_weights_after_loading at load time (absorbed attention). A forward hook on kv_b_proj is
right in prefill and wrong from the second generated token, and vLLM's own LoRA on kv_b_proj is ignored. So a
kv_b_proj adapter is merged and re-absorbed at each commit:

    stage    W = W_base + s * B @ A in fp32 from the checkpoint's own kv_b_proj weight (never accumulated on the
             previous version), rounded once to the serving dtype, checked finite
    commit   W copied into kv_b_proj.weight in place (prefill's up-projection reads it: on CPU kv_b_proj is never
             prepacked; the parameter keeps its loader attributes for full-weight sync), then
             MLAAttention.process_weights_after_loading re-derives W_UK_T / W_UV from it for decode (in fp32 they are
             views of that weight's storage, in bf16 copies: re-deriving is right in both cases)

A version without a kv_b_proj delta commits the base weight. Every layer is staged before any is committed. One
merged version at a time: several adapter versions in one batch cannot each have their own kv_b_proj (refused by
the runtime).
"""
from __future__ import annotations

import torch

KV_B = "self_attn.kv_b_proj"


def mla_attention(layer):
    """vLLM's MLAAttention of a decoder layer (the module holding W_UK_T / W_UV), None for a non-MLA layer."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    for mod in layer.modules():
        if isinstance(mod, MLAAttention):
            return mod
    return None


class KvBMerge:
    def __init__(self, layers, read_base, dtype: torch.dtype):
        """layers: vLLM's decoder layers; read_base(layer) -> the checkpoint's kv_b_proj weight [out, kv_lora_rank]."""
        self.attn = {li: a for li, layer in enumerate(layers) if (a := mla_attention(layer)) is not None}
        self.read_base, self.dtype = read_base, dtype
        self._base: dict[int, torch.Tensor] = {}
        self.merged = False                      # the served weights carry a delta

    def base(self, layer: int) -> torch.Tensor:
        if layer not in self._base:
            self._base[layer] = self.read_base(layer)
        return self._base[layer]

    def stage(self, deltas: dict[int, tuple[torch.Tensor, torch.Tensor, float]]) -> dict[int, torch.Tensor]:
        """deltas: layer -> (A [r, kv_lora_rank], B [out, r], scale); the weights every MLA layer then serves."""
        unknown = sorted(set(deltas) - set(self.attn))
        if unknown:
            raise ValueError(f"kv_b_proj adapter for layers {unknown}, which have no MLA attention in the served model")
        staged = {}
        for li, attn in self.attn.items():
            base = self.base(li)
            if li in deltas:
                A, B, s = deltas[li]
                w = (base.float() + s * (B.float() @ A.float())).to(self.dtype)
                if not torch.isfinite(w).all():
                    raise ValueError(f"layer {li}: merged kv_b_proj weight overflows {self.dtype}")
            else:
                w = base.to(self.dtype)
            served = attn.kv_b_proj.weight
            if w.shape != served.shape:
                raise ValueError(f"layer {li}: kv_b_proj weight {tuple(w.shape)} does not match the served "
                                 f"{tuple(served.shape)}")
            staged[li] = w.contiguous()
        return staged

    def commit(self, staged: dict[int, torch.Tensor], merged: bool) -> None:
        with torch.no_grad():
            for li, w in staged.items():
                attn = self.attn[li]
                attn.kv_b_proj.weight.data.copy_(w)
                attn.process_weights_after_loading(self.dtype)
        self.merged = merged
