"""Routed experts with per-expert LoRA in plain torch (the path for engines whose MoE kernels have no expert LoRA:
vLLM's CPU MoE backend, and expert parallelism on GPU). Base expert weights are a copy read once from the
checkpoint; routing reproduces the HF/Megatron math of the family (softmax top-k, or sigmoid + expert bias +
group-limited top-k + routed scaling)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.arch import MoEArch
from ..models.naming import naming_for


@dataclass
class MoEWeights:
    gate: torch.Tensor                 # [E, H] router
    bias: torch.Tensor | None          # [E] expert score correction bias
    w_gate: torch.Tensor               # [E, I, H]
    w_up: torch.Tensor                 # [E, I, H]
    w_down: torch.Tensor               # [E, H, I]


def load_moe_weights(ckpt, arch: MoEArch, layer: int) -> MoEWeights:
    """ckpt: anything with .get(name) -> tensor (safetensors reader)."""
    naming = naming_for(arch)
    names = [naming.expert_weights(layer, e) for e in range(arch.num_experts)]
    stack = lambda i: torch.stack([ckpt.get(n[i]).float() for n in names])  # noqa: E731
    router, bias = naming.router_weights(layer)
    bias = ckpt.get(bias).float() if arch.expert_bias else None
    return MoEWeights(ckpt.get(router).float(), bias, stack(0), stack(1), stack(2))


def route(logits: torch.Tensor, arch: MoEArch, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [T, E] -> (weights [T, k], expert ids [T, k])."""
    k = arch.topk
    if arch.score_function == "softmax":
        probs = torch.softmax(logits, dim=-1)
        w, ids = torch.topk(probs, k, dim=-1)
        if not arch.pre_softmax:
            w = w / w.sum(-1, keepdim=True)
        return w, ids
    scores = torch.sigmoid(logits)
    choice = scores + bias if bias is not None else scores
    if arch.num_groups:
        t, e = choice.shape
        g = choice.view(t, arch.num_groups, e // arch.num_groups).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(g).scatter_(1, torch.topk(g, arch.group_topk, dim=-1)[1], 1.0)
        mask = keep.unsqueeze(-1).expand(t, arch.num_groups, e // arch.num_groups).reshape(t, e)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    ids = torch.topk(choice, k, dim=-1)[1]
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    if arch.scaling_factor:
        w = w * arch.scaling_factor
    return w, ids


def _lin(x, W, lora):
    y = x @ W.t()
    if lora is not None:
        A, B, s = lora
        y = y + (x @ A.t()) @ B.t() * s
    return y


def routed_experts(x: torch.Tensor, mw: MoEWeights, arch: MoEArch, adapters: dict | None, scale: float,
                   on_route=None) -> torch.Tensor:
    """x [T, H] -> routed expert output [T, H] (fp32). adapters: {HF expert module: (A, B)} or None."""
    naming = naming_for(arch)
    xf = x.float()
    w, ids = route(xf @ mw.gate.t(), arch, mw.bias)
    if on_route is not None:
        on_route(ids)
    out = torch.zeros_like(xf)
    for e in torch.unique(ids).tolist():
        tok, pos = torch.where(ids == e)
        xe = xf[tok]
        gate, up, down = naming.expert_modules(e)
        get = (lambda m: (*adapters[m], scale) if adapters and m in adapters else None)  # noqa: E731
        h = F.silu(_lin(xe, mw.w_gate[e], get(gate))) * _lin(xe, mw.w_up[e], get(up))
        y = _lin(h, mw.w_down[e], get(down))
        out.index_add_(0, tok, y * w[tok, pos, None])
    return out
