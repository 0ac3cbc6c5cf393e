"""Router disagreement between two routings of the same tokens (pure torch): per decision (token x top-k slot),
over RoutesBatch (decisions and tokens, the R3 paper's router- and token-level figures), and restricted to a mask of
label positions. The log-prob statistics live in moe_lora_rl/mismatch.py."""
from __future__ import annotations

import torch


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


def routes_differs(a, b) -> list[torch.Tensor]:
    """Two RoutesBatch of the same samples: per sample, [tokens, layers, k] bool, whether `a`'s expert in that
    decision is not among `b`'s for that token and layer (the decisions routes_disagreement counts)."""
    if tuple(a.layer_ids) != tuple(b.layer_ids) or a.topk != b.topk or len(a.samples) != len(b.samples):
        raise ValueError(f"routes of layers {list(a.layer_ids)} top-{a.topk} for {len(a.samples)} samples cannot be "
                         f"compared with layers {list(b.layer_ids)} top-{b.topk} for {len(b.samples)} samples")
    out = []
    for i, (x, y) in enumerate(zip(a.samples, b.samples)):
        if x.shape != y.shape:
            raise ValueError(f"sample {i}: routes of shapes {x.shape} and {y.shape} cannot be compared")
        out.append(_differs(torch.from_numpy(x.astype("int64")), torch.from_numpy(y.astype("int64"))))
    return out


def masked_disagreement(differs: list[torch.Tensor], mask: torch.Tensor) -> dict:
    """routes_differs' decisions restricted to the positions where mask[i, t] (position t of a sample's routes is
    its input token t, i.e. mask column t of the [N, S-1] label tensors): the fraction of differing decisions
    (token x layer x top-k slot) and of tokens with one in at least one layer; 0.0 for both when mask selects none."""
    if len(differs) != mask.shape[0]:
        raise ValueError(f"routes for {len(differs)} samples, mask has {mask.shape[0]} rows")
    bad = decisions = bad_tokens = tokens = 0
    for i, d in enumerate(differs):
        if mask[i, d.shape[0]:].any():
            raise ValueError(f"sample {i}: mask selects position {int(mask[i].nonzero()[-1])}, beyond its "
                             f"{d.shape[0]} routed tokens")
        d = d[mask[i, :d.shape[0]]]                                       # [selected tokens, layers, k]
        bad += int(d.sum())
        decisions += d.numel()
        bad_tokens += int(d.flatten(1).any(-1).sum())
        tokens += d.shape[0]
    return {"decisions": bad / decisions if decisions else 0.0, "tokens": bad_tokens / tokens if tokens else 0.0}
