"""Label log-probabilities from vocab-parallel logits at a sampling temperature, and the sequence length a batch is
padded to so that sequence parallelism can split it.

    logits_local [b, S, V/tp] -> / temperature (one scalar, or one per row) -> log p(tokens[:, t+1]) [b, S]

Position S-1 has no label (its value is the log-prob of the rolled-around first token): callers keep [:, :S-1].
"""
from __future__ import annotations

import math

import torch

from ..megatron.train_step import token_log_probs
from ..router_replay.staging import StageView


def padded_len(seq_len: int, view: StageView) -> int:
    """S rounded up to a multiple of the TP size under sequence parallelism (each TP rank holds S / tp positions)."""
    split = view.tp_size if view.sequence_parallel else 1
    return math.ceil(seq_len / split) * split


def scaled_logits(logits_local: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """fp32 logits / temperature. temperature: a float, or a [b] tensor (one per row)."""
    logits = logits_local.float()
    if isinstance(temperature, torch.Tensor):
        return logits / temperature.to(logits.device, torch.float32).reshape(-1)[:, None, None]
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    return logits if temperature == 1.0 else logits / temperature


def label_logprobs(logits_local: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                   temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """[b, S] fp32 log p(tokens[:, t+1]) at `temperature` (autograd-aware, TP-reduced; padded vocab rows masked)."""
    labels = torch.roll(tokens, -1, dims=1).to(logits_local.device)
    return token_log_probs(scaled_logits(logits_local, temperature), labels, vocab_size)
