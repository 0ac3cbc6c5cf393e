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
    return float(_differs(a, b).double().mean())


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per decision (last dim: the top-k slots), whether a's expert is not among b's for that token."""
    return ~(a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)


def routes_disagreement(a, b) -> dict:
    """Two RoutesBatch of the same samples (e.g. the trainer's own routing, recorded, and the rollout's): the
    fraction of router decisions (token x layer x top-k slot) of `a` whose expert is not among `b`'s, and the
    fraction of tokens with such a decision in at least one MoE layer (the R3 paper's router- and token-level
    disagreement)."""
    if tuple(a.layer_ids) != tuple(b.layer_ids) or a.topk != b.topk or len(a.samples) != len(b.samples):
        raise ValueError(f"routes of layers {list(a.layer_ids)} top-{a.topk} for {len(a.samples)} samples cannot be "
                         f"compared with layers {list(b.layer_ids)} top-{b.topk} for {len(b.samples)} samples")
    bad = tokens = bad_tokens = 0
    for i, (x, y) in enumerate(zip(a.samples, b.samples)):
        if x.shape != y.shape:
            raise ValueError(f"sample {i}: routes of shapes {x.shape} and {y.shape} cannot be compared")
        x, y = torch.from_numpy(x.astype("int64")), torch.from_numpy(y.astype("int64"))
        differs = _differs(x, y)                                          # [tokens, layers, k]
        bad += int(differs.sum())
        tokens += x.shape[0]
        bad_tokens += int(differs.flatten(1).any(-1).sum())
    decisions = tokens * len(a.layer_ids) * a.topk
    return {"decisions": bad / decisions if decisions else 0.0, "tokens": bad_tokens / tokens if tokens else 0.0}
