"""One optimizer step of the adapters, the same for every driver:

    sync_adapter_grads -> [/ grad_divisor] -> global norm over unique owner shards -> finite? clip + AdamW step
                                                                                 -> non-finite? SKIP

The non-finite rule. A non-finite global adapter gradient norm (inf or nan on any shard of any rank: the norm is
all-reduced, so every rank sees it and every rank decides alike) SKIPS the step: the gradients are dropped (set to
None), the parameters and the AdamW state are untouched, the adapter version is not advanced, and the norm is
returned as it is (non-finite) with `skipped=True`. Why skip rather than raise: megatron-core's optimizer skips a
step whose grads hold inf/nan (its step() returns update_successful=False), and verl's engine contract is that
optimizer_step returns the grad norm, with verl's own engines (workers/engine/fsdp/transformer_impl.py,
torchtitan, veomni: "if grad_norm is not finite, skip the update" and zero the grads; dp_actor._optimizer_step in
older verl) skipping the update, so verl's trainer sees the non-finite norm in its metrics and training goes on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..lora.grad_norm import clip_adapter_grads
from ..lora.grad_sync import sync_adapter_grads
from ..lora.layers import adapter_factors


@dataclass(frozen=True)
class StepResult:
    grad_norm: float          # global adapter grad norm before clipping (non-finite when skipped)
    clipped: bool             # the grads were scaled down to max_norm
    skipped: bool             # non-finite norm: no step, grads dropped


def make_adamw(params: list, **adamw) -> torch.optim.AdamW:
    """AdamW over the adapters: the multi-tensor (foreach) update when every parameter is fp32, where it is bit-equal
    to the loop over tensors and much faster on CPU (thousands of per-expert factors; torch defaults to the loop
    off CUDA); on bf16 factors the two differ, so torch's default stays. An explicit `foreach` is kept."""
    if "foreach" not in adamw and params and all(p.dtype == torch.float32 for p in params):
        adamw["foreach"] = True
    return torch.optim.AdamW(params, **adamw)


def adapter_step(model, optimizer: torch.optim.Optimizer, max_norm: float, grad_divisor: int = 1) -> StepResult:
    """After backward: sync, divide by grad_divisor (verl scales each rank's loss by its dp size), clip to max_norm
    (<= 0: measure only), then AdamW; or skip on a non-finite norm (module docstring). Collective."""
    if not isinstance(grad_divisor, int) or grad_divisor < 1:
        raise ValueError(f"grad_divisor={grad_divisor!r} must be a positive integer")
    sync_adapter_grads(model)
    params = [p for _, p in adapter_factors(model)]
    if grad_divisor > 1:
        for p in params:
            p.grad.div_(grad_divisor)
    norm, clipped = clip_adapter_grads(model, max_norm)
    if not math.isfinite(norm):
        for p in params:
            p.grad = None
        return StepResult(norm, False, True)
    optimizer.step()
    return StepResult(norm, bool(clipped), False)
