"""Per-step train-inference mismatch diagnostics (pure): k3 KL between the training policy's and the rollout
engine's logprobs of the sampled tokens, with R3 and without it on the same rollouts, the fraction of tokens whose
probability ratio exceeds 2 and 5, and router disagreement per layer and overall."""
from __future__ import annotations

import torch

from ..router_replay.metrics import k3_kl, ratio_exceeds


def mismatch(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, *, prefix: str) -> dict:
    m = mask.double()
    return {f"{prefix}kl": k3_kl(train_lp, rollout_lp, m), f"{prefix}ratio_gt2": ratio_exceeds(train_lp, rollout_lp, 2.0, m),
            f"{prefix}ratio_gt5": ratio_exceeds(train_lp, rollout_lp, 5.0, m)}


def step_diagnostics(rollout_lp: torch.Tensor, mask: torch.Tensor, *, replayed: torch.Tensor | None,
                     unreplayed: torch.Tensor | None, disagreement: dict[int, float] | None) -> dict:
    """replayed: training logprobs under R3 (None when the run does not replay rollout routes); unreplayed: the
    recompute without replay of the same rows."""
    out: dict = {}
    if replayed is not None:
        out.update(mismatch(replayed, rollout_lp, mask, prefix="r3_"))
    if unreplayed is not None:
        out.update(mismatch(unreplayed, rollout_lp, mask, prefix="no_r3_"))
    if disagreement:
        out["disagreement"] = sum(disagreement.values()) / len(disagreement)
        out.update({f"disagreement_layer{l}": v for l, v in sorted(disagreement.items())})
    return out
