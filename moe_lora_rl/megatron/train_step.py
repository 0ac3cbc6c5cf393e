"""One training step of a megatron-core model (on its RunConfig's device): data split over data-parallel ranks, microbatches through the
pipeline schedule, token-sum loss normalised by the global token count (so gradients, summed over data-parallel
replicas, do not depend on the layout)."""
from __future__ import annotations

from typing import Callable

import torch

from .forward import model_run_config, run_schedule


def masked_vocab_logits(logits_local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Padded vocabulary rows (added so the vocab divides TP) must not enter the softmax."""
    from megatron.core import parallel_state as ps

    part = logits_local.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * part
    if start + part <= vocab_size:
        return logits_local
    keep = torch.arange(start, start + part, device=logits_local.device) < vocab_size
    return logits_local.masked_fill(~keep, float("-inf"))


def token_log_probs(logits_local: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(label) per token from vocab-parallel logits [b, s, V/tp] (autograd-aware, TP-reduced)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = masked_vocab_logits(logits_local.float(), vocab_size)
    return -vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous()
                                         ).transpose(0, 1)


def dp_slice(batch: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's share of a global batch [N, ...] (N must divide by DP)."""
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if batch.shape[0] % dp:
        raise ValueError(f"global batch of {batch.shape[0]} sequences does not split over data parallel size {dp}")
    n = batch.shape[0] // dp
    return batch[r * n:(r + 1) * n]


def lm_train_step(model, tokens: torch.Tensor, vocab_size: int, *, micro_batch_size: int = 1,
                  after_backward: Callable[[], None] | None = None) -> float:
    """Forward+backward of next-token loss over a global batch `tokens` [N, S]; returns the global mean loss
    (on every rank). Gradients accumulate in the model; the caller syncs and steps."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model.train()
    n, s = tokens.shape
    global_tokens = n * (s - 1)
    local = dp_slice(tokens)          # token ids stay on the CPU; run_schedule moves each microbatch
    mbs = [{"tokens": local[i:i + micro_batch_size]} for i in range(0, local.shape[0], micro_batch_size)]

    def loss_fn(logits_local, batch):
        toks = batch["tokens"]
        labels = torch.roll(toks, -1, dims=1).to(logits_local.device)
        lp = token_log_probs(logits_local, labels, vocab_size)[:, :-1]
        loss = -lp.sum() / global_tokens
        return loss, torch.tensor(1, dtype=torch.int, device=loss.device), {"loss": loss.detach()}

    outs = run_schedule(model, mbs, forward_only=False, on_output=loss_fn, seq_length=s,
                        micro_batch_size=micro_batch_size)
    dev = model_run_config(model).torch_device
    total = torch.zeros((), device=dev)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        total = sum((o["loss"].float() for o in outs), total)
    dist.all_reduce(total)
    if after_backward:
        after_backward()
    return float(total)
