"""Train-inference mismatch statistics (pure torch, a leaf: nothing of ours imported): how far the training policy's
log-probs of the sampled tokens are from the rollout engine's. Per token: the k3 KL, the fraction of tokens whose
probability ratio exceeds tau (either way) or falls below tau (the lower tail); what grows with response length: the
fraction of sequences with a token past a ratio, the largest |log sequence ratio|, each response split in halves.
per_token and by_length bundle them under a prefix (r3_, no_r3_) as rl/diagnostics.py reports them each step; the
router disagreement beside them is router_replay/disagreement.py's."""
from __future__ import annotations

import torch


LOW_TAIL = (0.5, 0.1, 1e-4)
"""The lower tail's thresholds of pi_train / pi_infer: Sparse-RL's token band floor (0.5), a tenth, and its
sequence veto (1e-4)."""
LOW_TAIL_KEYS = tuple(f"ratio_lt_{tau:g}" for tau in LOW_TAIL)        # ratio_lt_0.5, _0.1, _0.0001


def k3_kl(logp_train: torch.Tensor, logp_infer: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """k3 estimator of KL(pi_infer || pi_train) from tokens sampled by the inference engine:
    mean of (r - 1) - log r with r = pi_train / pi_infer."""
    log_r = (logp_train - logp_infer).double()
    k3 = torch.expm1(log_r) - log_r
    if mask is not None:
        return float((k3 * mask).sum() / mask.sum().clamp(min=1))
    return float(k3.mean())


def ratio_exceeds(logp_train: torch.Tensor, logp_infer: torch.Tensor, tau: float,
                  mask: torch.Tensor | None = None) -> float:
    """Fraction of tokens whose probability ratio (either way) exceeds tau."""
    bad = ((logp_train - logp_infer).abs() > torch.log(torch.tensor(float(tau)))).double()
    if mask is not None:
        return float((bad * mask).sum() / mask.sum().clamp(min=1))
    return float(bad.mean())


def ratio_below(logp_train: torch.Tensor, logp_infer: torch.Tensor, tau: float,
                mask: torch.Tensor | None = None) -> float:
    """Fraction of tokens whose ratio pi_train / pi_infer is below tau (the lower tail: tokens the sampler drew that
    the trained policy finds far less likely)."""
    floor = torch.log(torch.tensor(float(tau), dtype=torch.float64))
    low = ((logp_train - logp_infer).double() < floor).double()
    if mask is not None:
        return float((low * mask).sum() / mask.sum().clamp(min=1))
    return float(low.mean())


# -- per sequence and per half of each response: how the mismatch grows with length --------------------------------
def halves(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's True positions split at its midpoint: the first floor(n/2) of its n in the first half, the rest
    in the second (a response of one token has only a second half)."""
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"mask must be a 2-D bool tensor, got {mask.dtype} of shape {tuple(mask.shape)}")
    rank = mask.long().cumsum(-1)                                       # 1-based rank of each True position
    first = mask & (rank <= mask.sum(-1, keepdim=True) // 2)
    return first, mask & ~first


def seq_ratio_exceeds(logp_train: torch.Tensor, logp_infer: torch.Tensor, tau: float, mask: torch.Tensor) -> float:
    """Fraction of sequences (rows with a True position) with at least one token whose probability ratio (either
    way) exceeds tau, by ratio_exceeds' rule; 0.0 when no row has one."""
    bad = ((logp_train - logp_infer).abs() > torch.log(torch.tensor(float(tau)))) & mask
    rows = mask.any(-1)
    return float(bad.any(-1)[rows].double().mean()) if rows.any() else 0.0


def seq_log_ratio_max(logp_train: torch.Tensor, logp_infer: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest |sum of log pi_train - log pi_infer| of a sequence over its True positions (its log sequence
    ratio); 0.0 for an empty batch. Positions outside mask never enter (torch.where, not a product: no 0 * inf)."""
    log_r = torch.where(mask, (logp_train - logp_infer).double(), 0.0)
    return float(log_r.sum(-1).abs().max()) if log_r.numel() else 0.0


# -- the step's figures under a prefix ------------------------------------------------------------------------------
def per_token(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, *, prefix: str) -> dict:
    """Over the tokens of mask: the k3 KL, the fraction past ratio 2 and 5 (either way), the lower tail."""
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
