"""The merged serving mode: expert adapters folded into the weights vLLM's own MoE kernel reads, so the MoE path
runs no Python of ours.

    stage    from the pristine base copy (the checkpoint's values and dtype, read once): W = W_base + B @ A (scale
             folded into B) in fp32, rounded once to the serving dtype (never accumulated onto the previous
             version: repeated merging on a bf16 grid drifts; never from a base already rounded to it: an fp32
             checkpoint would be rounded twice), checked finite, then padded and prepacked by the kernel's own
             process_weights_after_loading on a scratch holder
    commit   copy the prepacked tensors into the layer's existing parameters (the kernel keeps its references)

Every layer is staged before any is committed, so a failed merge leaves the previous version serving. The engine
runs collective_rpc between steps, so no step sees a half-committed set.
"""
from __future__ import annotations

import torch

from .moe_torch import BaseExperts, ExpertLoRA


def experts_layer(block):
    """vLLM's routed-experts module of a MoE block (the one holding w13_weight / w2_weight)."""
    for mod in block.modules():
        if hasattr(mod, "w13_weight") and hasattr(mod, "quant_method"):
            return mod
    raise ValueError(f"no routed-experts module with w13_weight in {type(block).__name__}")


def merge_fp32(base: BaseExperts, lora: ExpertLoRA | None, dtype: torch.dtype, layer: int):
    """Unpacked merged (w13, w2) in the serving dtype; ValueError if the merge overflows it."""
    if lora is None:
        return base.w13.to(dtype), base.w2.to(dtype)
    r = lora.b1.shape[2]
    d13 = torch.cat([torch.bmm(lora.b1.float(), lora.a13[:, :r].float()),
                     torch.bmm(lora.b3.float(), lora.a13[:, r:].float())], 1)
    w13 = (base.w13.float() + d13).to(dtype)
    w2 = (base.w2.float() + torch.bmm(lora.b2.float(), lora.a2.float())).to(dtype)
    for name, w in (("gate/up", w13), ("down", w2)):
        if not torch.isfinite(w).all():
            raise ValueError(f"layer {layer}: merged expert {name} weights overflow {dtype} "
                             f"(max |W_base + s*B@A| is not representable)")
    return w13, w2


def prepack(layer_mod, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors the kernel reads for these unpacked weights: vLLM's process_weights_after_loading of the layer's
    experts (padding + prepack on CPU) run on a scratch module, so the served layer is untouched."""
    fused = layer_mod.quant_method.moe_kernel.fused_experts
    holder = torch.nn.Module()
    holder.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    holder.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    flag = getattr(fused, "_use_zentorch", None)
    if flag:                                   # zentorch reads unpacked weights
        return holder.w13_weight.data, holder.w2_weight.data
    fused.process_weights_after_loading(holder)
    if flag is not None:
        fused._use_zentorch = flag
    return holder.w13_weight.data, holder.w2_weight.data


class MergedExperts:
    def __init__(self, blocks: dict[int, object], bases: dict[int, BaseExperts], dtype: torch.dtype):
        self.layers = {l: experts_layer(b) for l, b in blocks.items()}
        self.bases, self.dtype = bases, dtype

    def stage(self, loras: dict[int, ExpertLoRA | None]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        staged = {}
        for l, mod in self.layers.items():
            w13, w2 = prepack(mod, *merge_fp32(self.bases[l], loras.get(l), self.dtype, l))
            if w13.shape != mod.w13_weight.shape or w2.shape != mod.w2_weight.shape:
                raise ValueError(f"layer {l}: prepacked expert weights {tuple(w13.shape)}/{tuple(w2.shape)} do "
                                 f"not match the served {tuple(mod.w13_weight.shape)}/{tuple(mod.w2_weight.shape)}")
            staged[l] = (w13, w2)
        return staged

    def commit(self, staged: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for l, (w13, w2) in staged.items():
                self.layers[l].w13_weight.data.copy_(w13)
                self.layers[l].w2_weight.data.copy_(w2)
