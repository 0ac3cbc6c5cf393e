"""Routed experts with per-expert LoRA in plain torch, batched (the unmerged serving mode: for engines whose MoE
kernels have no expert LoRA, vLLM's CPU MoE backend and expert parallelism on GPU; several adapter versions can
be held at once and served in one batch: all tokens routed together, the expert MLP run per version group). Tokens
are sorted by expert into an [experts, capacity, hidden] batch and every projection is one bmm over all experts,
base and LoRA factors alike. Routing reproduces the HF/Megatron math of the family (softmax top-k, or sigmoid +
expert bias + group-limited top-k + routed scaling) on vLLM's router logits. Base expert weights are a copy read
once from the checkpoint (vLLM's kernel holds them prepacked).

Numerics, in the order of vLLM's CPU fused-MoE kernel (csrc/cpu/cpu_fused_moe.cpp): the activation is rounded once
to the serving dtype (the down projection's input), the gate-weighted sum over the top-k experts is fp32 (routed
scaling folded into the fp32 weights) and rounded once; the LoRA delta (fp32 factors) is computed in fp32 and added
to the projection before the activation / the weighting. The GEMMs run in the base copy's dtype (EXPERT_PRECISION):

    serving   the copy in the serving dtype: the bf16 GEMMs accumulate in fp32 but torch on CPU writes their
              outputs in bf16, so the gate/up output is rounded before the activation and the down output before
              the weighting, where the kernel keeps fp32: ~1.65x the kernel's relative error per MoE layer
    fp32      an fp32 copy (exact for bf16/fp16 checkpoints; an fp32 checkpoint's own values): the kernel's numerics,
              at twice the weight bytes per GEMM (the unmerged mode's tokens/s -41% on the medium model, CPU)"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.arch import MoEArch
from ..models.naming import naming_for

PROJS = ("gate_proj", "up_proj", "down_proj")
EXPERT_PRECISION = {"serving": None, "fp32": torch.float32}   # -> the base copy's dtype (None: the serving dtype)


@dataclass
class BaseExperts:
    w13: torch.Tensor                  # [E, 2I, H] gate rows then up rows (vLLM's w13 layout)
    w2: torch.Tensor                   # [E, H, I]
    bias: torch.Tensor | None          # [E] expert score correction bias (fp32)


def load_base_experts(ckpt, arch: MoEArch, layer: int, dtype: torch.dtype | None) -> BaseExperts:
    """ckpt: anything with .get(name) -> tensor (safetensors reader); dtype None: the checkpoint's own."""
    naming = naming_for(arch)
    names = [naming.expert_weights(layer, e) for e in range(arch.num_experts)]
    stack = lambda i: torch.stack([ckpt.get(n[i]) for n in names]).to(dtype or ckpt.get(names[0][i]).dtype)  # noqa: E731
    bias = ckpt.get(naming.router_weights(layer)[1]).float() if arch.expert_bias else None
    return BaseExperts(torch.cat([stack(0), stack(1)], 1).contiguous(), stack(2).contiguous(), bias)


@dataclass
class ExpertLoRA:
    """One layer's expert adapters stacked over experts (fp32); missing projections are zeros."""
    a13: torch.Tensor                  # [E, 2r, H]  gate A rows then up A rows
    b1: torch.Tensor                   # [E, I, r]
    b3: torch.Tensor                   # [E, I, r]
    a2: torch.Tensor                   # [E, r, I]
    b2: torch.Tensor                   # [E, H, r]  (scale folded into the B factors)


def stack_expert_lora(mods: dict, arch: MoEArch, rank: int, scale: float, dtype: torch.dtype) -> ExpertLoRA | None:
    """mods: {HF expert module: (A, B)} of one layer -> ExpertLoRA, or None if it has no expert factors."""
    naming = naming_for(arch)
    modules = [naming.expert_modules(e) for e in range(arch.num_experts)]       # (gate, up, down) per expert
    if not any(m in mods for ms in modules for m in ms):
        return None
    E, H, I = arch.num_experts, arch.hidden_size, arch.moe_ffn_hidden_size
    din, dout = (H, H, I), (I, I, H)                                            # gate, up, down

    like = next(ab[0] for ab in mods.values())

    def factor(e, i, k):                       # k = 0: A [r, in], 1: B [out, r]
        ab = mods.get(modules[e][i])
        if ab is not None:
            return ab[k]
        return like.new_zeros((rank, din[i]) if k == 0 else (dout[i], rank))

    def stack(parts, k, scaled=False):
        """One torch.stack into the stacked buffer; B factors scaled in fp32 and rounded once to dtype."""
        out = torch.stack([factor(e, i, k) for e in range(E) for i in parts])
        if scaled:
            out = out.float() if out.dtype != torch.float32 else out
            out.mul_(scale)
        return out if out.dtype == dtype else out.to(dtype)
    # a13: gate A rows then up A rows per expert = [g0, u0, g1, u1, ...] stacked, viewed as [E, 2r, H]
    a13 = stack((0, 1), 0).view(E, 2 * rank, H)
    b1, b3 = stack((0,), 1, True), stack((1,), 1, True)
    return ExpertLoRA(a13, b1, b3, stack((2,), 0), stack((2,), 1, True))


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


def routed_experts(x: torch.Tensor, logits: torch.Tensor, base: BaseExperts, arch: MoEArch,
                   lora: ExpertLoRA | None, on_route=None, groups=None) -> torch.Tensor:
    """x [T, H] (serving dtype), router logits [T, E] -> routed expert output [T, H] in x's dtype.

    groups: several adapter versions in one batch, [(ExpertLoRA | None, token indices), ...] covering every token
    once (`lora` is then unused). All tokens are routed together (on_route sees them in order); the expert MLP runs
    per group on its tokens with its version's factors. None: every token on `lora`."""
    w, ids = route(logits.float(), arch, base.bias)
    if on_route is not None:
        on_route(ids)
    if groups is None:
        return _expert_mlp(x, w, ids, base, lora).to(x.dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for glora, idx in groups:
        out[idx] = _expert_mlp(x[idx], w[idx], ids[idx], base, glora)
    return out.to(x.dtype)


def _expert_mlp(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, base: BaseExperts,
                lora: ExpertLoRA | None) -> torch.Tensor:
    """Tokens x [T, H] routed to experts ids [T, k] with weights w [T, k] -> sum_k w * expert(x) [T, H] in fp32, in
    the order of vLLM's fused-MoE kernel (module docstring); base GEMMs in base's dtype, their outputs, the LoRA
    delta and the sums in fp32."""
    T, k = ids.shape
    E, I = base.w13.shape[0], base.w2.shape[2]
    cd = base.w13.dtype
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    counts = torch.bincount(flat, minlength=E)
    cap = int(counts.max())
    slot = torch.arange(T * k, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    tok = order // k
    xp = x.new_zeros(E, cap, x.shape[1], dtype=cd)
    xp[expert, slot] = x[tok].to(cd)
    h13 = torch.bmm(xp, base.w13.transpose(1, 2)).float()                   # [E, C, 2I]
    if lora is not None:
        f32 = lambda t: t.float()                                           # noqa: E731  (no-op on fp32)
        r = lora.b1.shape[2]
        t = torch.bmm(f32(xp), f32(lora.a13).transpose(1, 2))               # [E, C, 2r]
        h13[..., :I] += torch.bmm(t[..., :r], f32(lora.b1).transpose(1, 2))
        h13[..., I:] += torch.bmm(t[..., r:], f32(lora.b3).transpose(1, 2))
    h = (F.silu(h13[..., :I]) * h13[..., I:]).to(x.dtype)                   # the kernel's one rounding inside
    y = torch.bmm(h.to(cd), base.w2.transpose(1, 2)).float()                # [E, C, H]
    if lora is not None:
        y += torch.bmm(torch.bmm(f32(h), f32(lora.a2).transpose(1, 2)), f32(lora.b2).transpose(1, 2))
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y[expert, slot] * w.reshape(-1)[order, None].float())
    return out
