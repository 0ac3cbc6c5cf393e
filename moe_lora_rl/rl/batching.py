"""From the rollout engine's samples and their rewards to the policy's global batch (pure).

    policy_batch(samples, rewards, group_ids, pad_id, ...) -> PolicyBatch

Row i holds prompt + response right-padded to the longest row; position t of the [N, S-1] tensors is the label
tokens[i, t+1], so a response of R tokens after a prompt of P tokens owns positions P-1 .. P+R-2. The advantages
are verl's GRPO outcome advantages (one reward per response, normalised within its prompt's group).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..algos import grpo_advantages
from ..router_replay.routes import RoutesBatch
from ..policy.core import PolicyBatch


def response_spans(samples) -> list[tuple[int, int]]:
    """(first, end) label positions of each response."""
    return [(len(s.prompt) - 1, len(s.prompt) + len(s.response) - 1) for s in samples]


def policy_batch(samples: Sequence, rewards: Sequence[float], group_ids: Sequence[int], pad_id: int, *,
                 moe_layers: tuple[int, ...], num_experts: int, topk: int, norm_by_std: bool = True,
                 with_routes: bool = True, with_kv: bool = False) -> PolicyBatch:
    if not samples:
        raise ValueError("no samples: the rollout returned nothing to train on")
    if len(rewards) != len(samples) or len(group_ids) != len(samples):
        raise ValueError(f"{len(samples)} samples, {len(rewards)} rewards, {len(group_ids)} group ids")
    empty = [i for i, s in enumerate(samples) if not s.response]
    if empty:
        raise ValueError(f"samples {empty[:8]} have an empty response")
    lengths = [len(s.prompt) + len(s.response) for s in samples]
    n, width = len(samples), max(lengths)
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1), dtype=torch.bool)
    rollout_lp = torch.zeros((n, width - 1), dtype=torch.float32)
    resp_len = max(len(s.response) for s in samples)
    resp_mask = torch.zeros((n, resp_len), dtype=torch.bool)
    for i, (s, (a, b)) in enumerate(zip(samples, response_spans(samples))):
        if len(s.logprobs) != len(s.response):
            raise ValueError(f"sample {i}: {len(s.logprobs)} rollout logprobs for {len(s.response)} response tokens")
        tokens[i, :lengths[i]] = torch.tensor(list(s.prompt) + list(s.response))
        loss_mask[i, a:b] = True
        rollout_lp[i, a:b] = torch.tensor(s.logprobs, dtype=torch.float32)
        resp_mask[i, :len(s.response)] = True
    adv_resp = grpo_advantages(torch.tensor(rewards, dtype=torch.float32), resp_mask, list(group_ids),
                               norm_by_std=norm_by_std)
    advantages = torch.zeros((n, width - 1), dtype=torch.float32)
    for i, (a, b) in enumerate(response_spans(samples)):
        advantages[i, a:b] = adv_resp[i, :b - a]
    routes = None
    if with_routes:
        missing = [i for i, s in enumerate(samples) if s.routes is None]
        if missing:
            raise ValueError(f"samples {missing[:8]} came back without routes (is capture on in the engine?)")
        routes = RoutesBatch([np.asarray(s.routes) for s in samples], tuple(moe_layers), num_experts, topk)
        for i, (r, n_tok) in enumerate(zip(routes.samples, lengths)):
            if r.shape[0] != n_tok - 1:
                raise ValueError(f"sample {i}: routes cover {r.shape[0]} tokens; its {n_tok} tokens need "
                                 f"{n_tok - 1} (every token but the last)")
    kv = None
    if with_kv:
        missing = [i for i, s in enumerate(samples) if getattr(s, "kv_kept", None) is None]
        if missing:
            raise ValueError(f"samples {missing[:8]} came back without their eviction record (is kv_replay on in "
                             "the engine?)")
        kv = [s.kv_kept for s in samples]
    return PolicyBatch(tokens=tokens, lengths=lengths, loss_mask=loss_mask, advantages=advantages,
                       rollout_logprobs=rollout_lp, routes=routes, group_ids=list(group_ids), kv_kept=kv)
