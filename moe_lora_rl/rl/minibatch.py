"""PPO mini-batches of a rollout batch (pure): which rows each optimizer step trains on, and that sub-batch.

    for rows in mini_batch_rows(batch.num_rows, mini_batches):    # epoch after epoch, the same slices in order
        policy.update(select(batch, rows), old[rows], routes=select_routes(recorded, rows), ...)

Mini-batch j is the contiguous slice of rows [j*n/m, (j+1)*n/m). The rows of a rollout batch come group by group
(rl/batching.py), so a mini-batch holds whole GRPO groups whenever group_size divides n/m; otherwise a group is cut at
a boundary, which changes nothing in the loss: advantages were computed over the whole group before the split.
No shuffling (verl's actor.shuffle defaults to off too). The sub-batch keeps the batch's sequence length (the shapes
stay those of the rollout batch; the update pads to it anyway).
"""
from __future__ import annotations

import dataclasses
import numbers

from ..policy.batch import PolicyBatch
from ..router_replay.routes import RoutesBatch


def mini_batch_rows(n: int, mini_batches: int) -> list[list[int]]:
    """The rows of each mini-batch, in order: contiguous slices of n // mini_batches rows."""
    if not isinstance(mini_batches, int) or isinstance(mini_batches, bool) or mini_batches < 1:
        raise ValueError(f"mini_batches={mini_batches!r} must be an integer >= 1")
    if n % mini_batches:
        raise ValueError(f"mini_batches={mini_batches} does not divide the batch of {n} rows")
    k = n // mini_batches
    return [list(range(j * k, (j + 1) * k)) for j in range(mini_batches)]


def select_routes(routes: RoutesBatch | None, rows: list[int]) -> RoutesBatch | None:
    """The routes of `rows`' samples, in that order (None stays None)."""
    if routes is None:
        return None
    _check_rows(rows, len(routes.samples))
    return RoutesBatch([routes.samples[i] for i in rows], routes.layer_ids, routes.num_experts, routes.topk)


def select(batch: PolicyBatch, rows: list[int]) -> PolicyBatch:
    """The sub-batch of `rows` (in that order): tokens, lengths, masks, advantages, rollout logprobs, routes, group
    ids and eviction records of those rows; the sequence length unchanged."""
    _check_rows(rows, batch.num_rows)
    idx = list(rows)
    return dataclasses.replace(
        batch, tokens=batch.tokens[idx], lengths=[batch.lengths[i] for i in idx], loss_mask=batch.loss_mask[idx],
        advantages=batch.advantages[idx],
        rollout_logprobs=None if batch.rollout_logprobs is None else batch.rollout_logprobs[idx],
        routes=select_routes(batch.routes, idx), group_ids=[batch.group_ids[i] for i in idx],
        kv_kept=None if batch.kv_kept is None else [batch.kv_kept[i] for i in idx])


def _check_rows(rows, n: int) -> None:
    if not len(rows) or any(not isinstance(i, numbers.Integral) or isinstance(i, bool) or not 0 <= i < n
                                for i in rows):
        raise ValueError(f"rows {list(rows)} must be a non-empty list of row indices in 0..{n - 1}")
