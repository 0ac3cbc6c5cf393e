"""Per-step train-inference mismatch diagnostics (pure): k3 KL between the training policy's and the rollout
engine's logprobs of the sampled tokens, with R3 and without it on the same rollouts, the fraction of tokens whose
probability ratio exceeds 2 and 5 and of those whose pi_train / pi_infer is below 0.5, 0.1 and 1e-4 (the lower
tail), and router disagreement per layer and overall; and what grows with response
length: the fraction of sequences with a token past ratio 2, the largest |log sequence ratio|, and the KL and the
free router disagreement over the first vs the second half of each response."""
from __future__ import annotations

import torch

from ..router_replay.metrics import (halves, k3_kl, masked_disagreement, ratio_below, ratio_exceeds, routes_differs,
                                     routes_disagreement, seq_log_ratio_max, seq_ratio_exceeds)


LOW_TAIL = (0.5, 0.1, 1e-4)
"""The lower tail's thresholds of pi_train / pi_infer: Sparse-RL's token band floor (0.5), a tenth, and its
sequence veto (1e-4)."""
LOW_TAIL_KEYS = tuple(f"ratio_lt_{tau:g}" for tau in LOW_TAIL)        # ratio_lt_0.5, _0.1, _0.0001


def mismatch(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, *, prefix: str) -> dict:
    m = mask.double()
    return {f"{prefix}kl": k3_kl(train_lp, rollout_lp, m), f"{prefix}ratio_gt2": ratio_exceeds(train_lp, rollout_lp, 2.0, m),
            f"{prefix}ratio_gt5": ratio_exceeds(train_lp, rollout_lp, 5.0, m),
            **{f"{prefix}{k}": ratio_below(train_lp, rollout_lp, tau, m)
               for tau, k in zip(LOW_TAIL, LOW_TAIL_KEYS)}}


def by_length(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, *, prefix: str) -> dict:
    """Per sequence: the fraction with a token past ratio 2 and the largest |log sequence ratio|; per half of each
    response (tokens pooled over rows): the k3 KL."""
    first, second = halves(mask)
    return {f"{prefix}seq_ratio_gt2": seq_ratio_exceeds(train_lp, rollout_lp, 2.0, mask),
            f"{prefix}seq_log_ratio_max": seq_log_ratio_max(train_lp, rollout_lp, mask),
            f"{prefix}kl_first_half": k3_kl(train_lp, rollout_lp, first.double()),
            f"{prefix}kl_second_half": k3_kl(train_lp, rollout_lp, second.double())}


def step_diagnostics(rollout_lp: torch.Tensor, mask: torch.Tensor, *, replayed: torch.Tensor | None,
                     unreplayed: torch.Tensor | None, disagreement: dict[int, float] | None,
                     token_disagreement: float | None = None, free_routes=None, rollout_routes=None) -> dict:
    """replayed: training logprobs under R3 (None when the run does not replay rollout routes); unreplayed: the
    recompute without replay of the same rows; disagreement: per MoE layer, the fraction of router decisions where
    the trainer's own top-k differs from the rollout's (at each layer, on the rollout's routes upstream);
    token_disagreement: the fraction of tokens with such a decision in at least one layer; free_routes: the
    trainer's own routes without replay (every layer routing freely, so a flip upstream changes what follows), with
    rollout_routes: the R3 paper's router- and token-level disagreement (free_disagreement,
    free_token_disagreement) over every routed token of the batch, prompt tokens included (once per sample), and
    the same over the first and the second half of each response's tokens (free_disagreement_first_half, ...); in
    mode=async a token's rollout route may come from an older adapter version, which adds staleness to the figure."""
    out: dict = {}
    if replayed is not None:
        out.update(mismatch(replayed, rollout_lp, mask, prefix="r3_")
                   | by_length(replayed, rollout_lp, mask, prefix="r3_"))
    if unreplayed is not None:
        out.update(mismatch(unreplayed, rollout_lp, mask, prefix="no_r3_")
                   | by_length(unreplayed, rollout_lp, mask, prefix="no_r3_"))
    if disagreement:
        out["disagreement"] = sum(disagreement.values()) / len(disagreement)
        out.update({f"disagreement_layer{l}": v for l, v in sorted(disagreement.items())})
    if token_disagreement is not None:
        out["token_disagreement"] = token_disagreement
    if free_routes is not None and rollout_routes is not None:
        free = routes_disagreement(free_routes, rollout_routes)
        out["free_disagreement"], out["free_token_disagreement"] = free["decisions"], free["tokens"]
        differs = routes_differs(free_routes, rollout_routes)
        for name, half in zip(("first_half", "second_half"), halves(mask)):
            d = masked_disagreement(differs, half)
            out[f"free_disagreement_{name}"], out[f"free_token_disagreement_{name}"] = d["decisions"], d["tokens"]
    return out
