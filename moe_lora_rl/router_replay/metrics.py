"""Train-inference mismatch diagnostics (pure torch)."""
from __future__ import annotations

import torch


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


def router_disagreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of router decisions (token x top-k slot) of `a` whose expert is not among `b`'s for that token."""
    if a.shape != b.shape:
        raise ValueError(f"routes of shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be compared")
    if a.numel() == 0:
        return 0.0
    same = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)
    return float(1.0 - same.double().mean())
