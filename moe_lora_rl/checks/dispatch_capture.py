"""What megatron-core's token dispatcher actually receives, and what it should receive, for the Router Replay checks.

capture_routing_maps(model): a scoped instance-level wrapper on every MoE layer's
`token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)` (the same signature in megatron-core 0.16.1
and 0.19.x) that keeps each routing map ([tokens, experts] bool) per global layer number.

expected_rows(...): the rollout-format routes ([tokens, moe_layers, top_k] per sample) of the tokens one rank's router
sees, in megatron's order, computed from token positions with no code from moe_lora_rl.router_replay: padded (BSHD)
batches are [seq, batch] flattened seq-major, packed batches are the samples concatenated, and under sequence
parallelism a TP rank holds a contiguous block of the sequence dimension. Padding positions carry the documented
padding routes: pad token j of batch row b gets experts ((b * padded_len + j) * k + 0..k-1) mod E.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def capture_routing_maps(model):
    got: dict[int, list[torch.Tensor]] = {}
    dispatchers = []

    def wrap(disp, layer_id):
        original = disp.dispatch_preprocess

        def dispatch_preprocess(hidden_states, routing_map, probs):
            got.setdefault(layer_id, []).append(routing_map.detach().clone())
            return original(hidden_states, routing_map, probs)
        return dispatch_preprocess

    try:
        for layer in model.decoder.layers:
            disp = getattr(getattr(layer, "mlp", None), "token_dispatcher", None)
            if disp is None:
                continue
            disp.dispatch_preprocess = wrap(disp, layer.layer_number - 1)
            dispatchers.append(disp)
        yield got
    finally:
        for disp in dispatchers:
            disp.__dict__.pop("dispatch_preprocess", None)


def map_to_ids(routing_map: torch.Tensor, topk: int) -> np.ndarray:
    """[tokens, experts] bool -> [tokens, topk] sorted expert ids; a row with another count of experts is -1s."""
    m = routing_map.bool().cpu().numpy()
    out = np.full((m.shape[0], topk), -1, dtype=np.int64)
    for t in range(m.shape[0]):
        ids = np.flatnonzero(m[t])
        if len(ids) == topk:
            out[t] = ids
    return out


def expected_rows(samples: list[np.ndarray], col: int, lengths: list[int], *, padded_len: int | None,
                  num_experts: int, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False) -> np.ndarray:
    """[local_tokens, topk] sorted expert ids this rank's router sees for MoE layer column `col`.

    samples: the microbatch's rollout-format routes (at least lengths[b] rows each); lengths: tokens per sample."""
    k = samples[0].shape[2]
    if padded_len is None:
        order = [(b, p) for b in range(len(lengths)) for p in range(lengths[b])]
    else:
        order = [(b, p) for p in range(padded_len) for b in range(len(lengths))]
    if sequence_parallel and tp_size > 1:
        n = len(order) // tp_size
        order = order[tp_rank * n:(tp_rank + 1) * n]
    rows = []
    for b, p in order:
        if p < lengths[b]:
            rows.append(np.asarray(samples[b][p, col], dtype=np.int64))
        else:
            t = b * padded_len + p - lengths[b]
            rows.append((t * k + np.arange(k)) % num_experts)
    return np.sort(np.stack(rows), axis=-1)
