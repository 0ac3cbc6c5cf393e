"""Per-step train-inference mismatch diagnostics (pure): k3 KL between the training policy's and the rollout
engine's logprobs of the sampled tokens, with R3 and without it on the same rollouts, the fraction of tokens whose
probability ratio exceeds 2 and 5, and router disagreement per layer and overall."""
from __future__ import annotations

import torch

from ..router_replay.metrics import k3_kl, ratio_exceeds, routes_disagreement


def mismatch(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, *, prefix: str) -> dict:
    m = mask.double()
    return {f"{prefix}kl": k3_kl(train_lp, rollout_lp, m), f"{prefix}ratio_gt2": ratio_exceeds(train_lp, rollout_lp, 2.0, m),
            f"{prefix}ratio_gt5": ratio_exceeds(train_lp, rollout_lp, 5.0, m)}


def step_diagnostics(rollout_lp: torch.Tensor, mask: torch.Tensor, *, replayed: torch.Tensor | None,
                     unreplayed: torch.Tensor | None, disagreement: dict[int, float] | None,
                     token_disagreement: float | None = None, free_routes=None, rollout_routes=None) -> dict:
    """replayed: training logprobs under R3 (None when the run does not replay rollout routes); unreplayed: the
    recompute without replay of the same rows; disagreement: per MoE layer, the fraction of router decisions where
    the trainer's own top-k differs from the rollout's (at each layer, on the rollout's routes upstream);
    token_disagreement: the fraction of tokens with such a decision in at least one layer; free_routes: the
    trainer's own routes without replay (every layer routing freely, so a flip upstream changes what follows), with
    rollout_routes: the R3 paper's router- and token-level disagreement (free_disagreement,
    free_token_disagreement) over every routed token of the batch, prompt tokens included (once per sample); in
    mode=async a token's rollout route may come from an older adapter version, which adds staleness to the figure."""
    out: dict = {}
    if replayed is not None:
        out.update(mismatch(replayed, rollout_lp, mask, prefix="r3_"))
    if unreplayed is not None:
        out.update(mismatch(unreplayed, rollout_lp, mask, prefix="no_r3_"))
    if disagreement:
        out["disagreement"] = sum(disagreement.values()) / len(disagreement)
        out.update({f"disagreement_layer{l}": v for l, v in sorted(disagreement.items())})
    if token_disagreement is not None:
        out["token_disagreement"] = token_disagreement
    if free_routes is not None and rollout_routes is not None:
        free = routes_disagreement(free_routes, rollout_routes)
        out["free_disagreement"], out["free_token_disagreement"] = free["decisions"], free["tokens"]
    return out
