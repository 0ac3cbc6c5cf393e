"""The global gradient norm of the adapters, each factor shard counted once, and clipping to it.

After sync_adapter_grads every copy of a replicated factor holds the same gradient; the norm sums squares from one
owner per replica set (state.is_owner: rank 0 of every group the factor is reduced over), so a factor replicated
over TP/ETP/EP/DP is counted once and a sharded one once per shard, then all-reduces over the world (which also adds
the pipeline stages). Every rank gets the same norm and applies the same scale.

A non-finite norm is returned, never raised: the caller decides (policy/optimizer_step.py skips the step, the project's one
non-finite rule), and such grads are left unscaled.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .layers import adapter_factors
from .state import is_owner


@torch.no_grad()
def adapter_grad_norm(model) -> float:
    sq = torch.zeros((), dtype=torch.float64)
    for _, p in adapter_factors(model):
        if p.grad is not None and is_owner(p.lora_meta):
            sq += p.grad.detach().double().pow(2).sum().cpu()
    if dist.is_initialized():
        dist.all_reduce(sq)
    return math.sqrt(float(sq))


@torch.no_grad()
def clip_adapter_grads(model, max_norm: float, eps: float = 1e-6) -> tuple[float, bool]:
    """(global norm before clipping, whether it was clipped): grads scaled by max_norm / (norm + eps) when the norm
    exceeds max_norm (torch.nn.utils.clip_grad_norm_'s rule). max_norm <= 0 only measures. A non-finite norm is
    returned with the grads unscaled and clipped False (policy/optimizer_step.py then skips the step)."""
    norm = adapter_grad_norm(model)
    clipped = math.isfinite(norm) and max_norm > 0 and norm > max_norm
    if clipped:
        coef = max_norm / (norm + eps)
        for _, p in adapter_factors(model):
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm, clipped
