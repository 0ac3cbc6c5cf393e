"""Run a megatron-core model through its pipeline schedule and collect outputs on the last stage.

The same entry point serves PP=1 and PP>1: megatron's forward_backward_func does the stage hand-offs. The model's
RunConfig (set by build_model) says where inputs go; on CPU the caller has applied megatron-core's CPU support once
(run_config.prepare_host) and the schedule runs inside its scoped device='cuda' -> cpu rewrite.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch

from .layer_masks import layer_masks
from .run_config import RunConfig


def model_run_config(model) -> RunConfig:
    rc = getattr(model, "run_config", None)
    if rc is None:
        raise ValueError(f"{type(model).__name__} has no run_config: build it with megatron.build.build_model")
    return rc


def schedule_scope(rc: RunConfig):
    """CPU: the PP schedule allocates with device='cuda'; rewrite those allocations (needs the CPU support applied
    by the caller, checked here rather than applied). CUDA: nothing."""
    if rc.device != "cpu":
        return contextlib.nullcontext()
    from . import cpu_support

    if cpu_support.active() is None:
        raise RuntimeError("megatron-core's CPU support is not applied: call run_config.prepare_host(rc) once before "
                           "the first forward")
    return cpu_support.cuda_device_kwargs_to_cpu()


def model_scope(rc: RunConfig):
    """Inside schedule_scope: the model's forward itself runs without the CPU rewrite (cpu_support.model_code)."""
    if rc.device != "cpu":
        return contextlib.nullcontext()
    from . import cpu_support

    return cpu_support.model_code()


def causal_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """position ids and the explicit boolean causal mask ([1,1,S,S], True = masked): megatron's default mask is
    allocated on 'cuda'."""
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    return pos, mask


def packed_inputs(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples packed into one sequence: positions restart per sample, attention is block-diagonal causal
    (the local attention path's equivalent of THD packing)."""
    total = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for n in lengths:
        allowed[start:start + n, start:start + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        start += n
    return pos, (~allowed)[None, None]


def has_delta_net(config) -> bool:
    """True for a megatron config with Gated DeltaNet layers (the hybrid linear-attention family's build)."""
    return getattr(config, "experimental_attention_variant", None) == "gated_delta_net"


def refuse_packed_on_hybrid(config, position_ids: torch.Tensor | None) -> None:
    """ValueError for samples packed into one row (positions restarting within it, packed_inputs) on a hybrid
    linear-attention model: a block-diagonal mask separates samples in attention only, the delta-net's conv and
    recurrent state would run from one sample into the next (megatron-core's GatedDeltaNet takes no packed sequences:
    it raises NotImplementedError for packed_seq_params). Measured through the replay bench before this check:
    packed logits 27 off HF's per sample, padded 9.7e-5."""
    if not has_delta_net(config) or position_ids is None:
        return
    if position_ids.dim() == 2 and position_ids.shape[1] > 1 and bool((position_ids.diff(dim=1) <= 0).any()):
        raise ValueError("packed samples (positions restarting within a row) on a hybrid linear-attention model: "
                         "the delta-net's state would run across samples; pad each sample to its own row")


def gather_vocab(logits_local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[b, s, V/tp] vocab-parallel logits -> [b, s, V] (padding rows trimmed)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits_local)[..., :vocab_size]


def run_schedule(model, microbatches: list[dict], *, forward_only: bool,
                 on_output: Callable[[torch.Tensor, dict], object], seq_length: int, micro_batch_size: int):
    """Run every microbatch; `on_output(local_logits, batch)` runs on the last stage and its results are returned.

    When forward_only is False, on_output must return (loss, num_tokens, logged) as megatron's loss functions do,
    and gradients accumulate in the model.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rc = model_run_config(model)
    dev = rc.torch_device
    it = iter(microbatches)

    def step(data_iterator, m):
        batch = next(data_iterator)
        pos, mask = causal_inputs(batch["tokens"])
        pos, mask = batch.get("position_ids", pos), batch.get("attention_mask", mask)
        with model_scope(rc), layer_masks(m, batch.get("layer_masks")):
            out = m(input_ids=batch["tokens"].to(dev), position_ids=pos.to(dev), attention_mask=mask.to(dev))
        if forward_only:
            return out, lambda t, non_loss_data=False: on_output(t, batch)
        return out, partial(on_output, batch=batch)

    with schedule_scope(rc):
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=it, model=[model], num_microbatches=len(microbatches),
            seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only,
            collect_non_loss_data=forward_only)


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, vocab_size: int, **inputs) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, V] as fp32 on the CPU (whatever the model's dtype and device) on last-stage
    ranks, None on the others. inputs: optional position_ids / attention_mask (e.g. packed_inputs)."""
    from megatron.core import parallel_state as ps

    refuse_packed_on_hybrid(getattr(model, "config", None), inputs.get("position_ids"))
    model.eval()
    b, s = tokens.shape
    outs = run_schedule(model, [{"tokens": tokens, **inputs}], forward_only=True,
                        on_output=lambda t, batch: gather_vocab(t, vocab_size).float().cpu(),
                        seq_length=s, micro_batch_size=b)
    return outs[0] if ps.is_pipeline_last_stage() else None
