"""Per-step train-inference mismatch diagnostics (pure): the log-prob statistics of moe_lora_rl/mismatch.py (k3 KL,
ratio tails, per sequence and per half of each response) with R3 and without it on the same rollouts, and
router_replay/disagreement.py's router disagreement per layer and overall, free and over each half of the
responses. step_diagnostics puts them in one dict under the keys the metrics log."""
from __future__ import annotations

import torch

from ..mismatch import by_length, halves, per_token
from ..router_replay.disagreement import masked_disagreement, routes_differs, routes_disagreement


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
        out.update(per_token(replayed, rollout_lp, mask, prefix="r3_")
                   | by_length(replayed, rollout_lp, mask, prefix="r3_"))
    if unreplayed is not None:
        out.update(per_token(unreplayed, rollout_lp, mask, prefix="no_r3_")
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
