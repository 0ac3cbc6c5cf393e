"""One trainer step on a batch of whole groups, the same in both loops (every rank): GRPO advantages, the replayed
logprob pass (the proximal policy: the trainer before the update, R3 routes of whichever version produced each
token), the optional reference pass, the update (decoupled PPO: clip on policy / proximal, rollout correction on
proximal / behaviour, behaviour being the engine's per-token logprobs) and the mismatch diagnostics.

    metrics, skipped, proximal = train_on(policy, cfg, batch)   # batch = policy_batch(samples, rewards, ...)
"""
from __future__ import annotations

import torch

from .diagnostics import step_diagnostics


def train_on(policy, cfg, batch) -> tuple[dict, bool, torch.Tensor]:
    """The step's metrics, whether it was skipped, and the proximal logprobs it used."""
    a = cfg.algo
    replayed = policy.logprobs(batch, replay="r3")              # R3: the rollout's routes
    unreplayed = policy.logprobs(batch, replay="record")       # the trainer's own routing, recorded
    old = {"r3": replayed, "r2": unreplayed, "off": unreplayed}[cfg.replay]
    ref = policy.logprobs(batch, replay="r3" if cfg.replay == "r3" else "off", adapter=False).logprobs \
        if a.kl_coef > 0 else None
    upd = policy.update(batch, old.logprobs, replay="off" if cfg.replay == "off" else "r3",
                        routes=unreplayed.recorded if cfg.replay == "r2" else None, ref_logprobs=ref,
                        kl_coef=a.kl_coef, rollout_is=None if a.rollout_is == "off" else a.rollout_is,
                        rollout_is_threshold=a.rollout_is_threshold, sparse=a.sparse_settings())
    skipped = upd.pop("skipped")            # a non-finite grad norm: no step, the version unchanged
    diag = step_diagnostics(batch.rollout_logprobs, batch.loss_mask, replayed=replayed.logprobs,
                            unreplayed=unreplayed.logprobs, disagreement=replayed.disagreement,
                            token_disagreement=replayed.token_disagreement,
                            free_routes=unreplayed.recorded, rollout_routes=batch.routes)
    return {**upd, **diag}, skipped, old.logprobs


def effective_sample_size(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> float:
    """Normalised effective sample size of the token importance weights w = pi_proximal / pi_behaviour over the
    masked tokens: (sum w)^2 / (n sum w^2), 1 when the data is on-policy, towards 1/n as it goes off."""
    w = torch.exp((proximal.double() - behaviour.double())[mask])
    if w.numel() == 0:
        raise ValueError("no token to weigh")
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))
