"""Router replay for the policy's microbatches: check a batch's routes against the model, queue them per microbatch
on this rank's stage, and turn what the routers measured or recorded back into global results.

    check_routes (every rank, before any collective) -> queue_routes (aligned to the right padding, this stage's
    layers, this TP rank's sequence slice) -> forward -> disagreement (all-reduced per global layer) |
    gather_recorded (R2: every rank's recorded routes reassembled into one RoutesBatch)

The routes of a sample cover its tokens but the last (the capture format: the sampling engine never runs the final
token through the model); that token and the right padding get spread padding routes, which only change positions
whose logprobs are not of a real label.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .align import align_microbatch, real_token_mask, unalign_microbatch
from .replayer import RouterReplayer
from .routes import RoutesBatch


@dataclass(frozen=True)
class StageView:
    """Where this rank's routers sit: the sequence slice they see and the model's MoE layers (all stages)."""
    tp_rank: int
    tp_size: int
    sequence_parallel: bool
    moe_layers: tuple[int, ...]          # global MoE layer numbers of the whole model
    num_experts: int
    topk: int

    @property
    def sp(self) -> dict:
        return dict(tp_rank=self.tp_rank, tp_size=self.tp_size, sequence_parallel=self.sequence_parallel)


def stage_view(model, arch) -> StageView:
    from megatron.core import parallel_state as ps

    return StageView(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                     bool(model.config.sequence_parallel), tuple(arch.moe_layer_ids), int(arch.num_experts),
                     int(arch.topk))


def check_routes(routes: RoutesBatch | None, lengths: list[int], view: StageView) -> RoutesBatch:
    """The routes fit the batch (one per sample, lengths[i] - 1 tokens each) and the model (every MoE layer, its
    expert count and top-k). Raises the same ValueError on every rank (the batch is identical everywhere)."""
    if routes is None:
        raise ValueError("replay='r3' needs routes (batch.routes or routes=...), got None")
    if not isinstance(routes, RoutesBatch):
        raise ValueError(f"routes must be a RoutesBatch, got {type(routes).__name__}")
    if routes.num_experts != view.num_experts or routes.topk != view.topk:
        raise ValueError(f"routes are for {routes.num_experts} experts top-{routes.topk}; the model has "
                         f"{view.num_experts} experts top-{view.topk}")
    missing = [l for l in view.moe_layers if l not in routes.layer_ids]
    if missing:
        raise ValueError(f"routes have no MoE layers {missing} (routes layers {list(routes.layer_ids)}, model MoE "
                         f"layers {list(view.moe_layers)})")
    if len(routes.samples) != len(lengths):
        raise ValueError(f"routes for {len(routes.samples)} samples, batch has {len(lengths)}")
    for i, (n, r) in enumerate(zip(lengths, routes.samples)):
        if r.shape[0] != n - 1:
            raise ValueError(f"sample {i}: routes cover {r.shape[0]} tokens; a sample of {n} tokens needs {n - 1} "
                             "(every token but the last)")
    return routes


def queue_routes(replayer: RouterReplayer, routes: RoutesBatch, microbatches: list[list[int]], lengths: list[int],
                 padded_len: int, view: StageView, measure: bool) -> None:
    """Queue every microbatch's routes, in schedule order, on this stage's routers. measure: also measure router
    disagreement over the routed tokens."""
    for ids in microbatches:
        aligned = align_microbatch(routes, ids, padded_len=padded_len, stage_layers=replayer.layer_ids, **view.sp)
        real = real_token_mask([lengths[i] - 1 for i in ids], padded_len=padded_len, **view.sp) if measure else None
        replayer.queue_microbatch(aligned, real)


def disagreement(replayer: RouterReplayer, num_layers: int) -> dict[int, float]:
    """{global MoE layer: fraction of routed-token decisions where the router's own top-k differs from the replayed
    route} over the whole global batch (collective over the world)."""
    counts = torch.zeros(num_layers, 2, dtype=torch.float64)
    for layer, (bad, total) in replayer.pop_disagreement().items():
        counts[layer] += torch.tensor([bad, total], dtype=torch.float64)
    dist.all_reduce(counts)              # DP ranks: other samples; SP ranks: other positions; PP: other layers
    # (TP ranks without sequence parallelism count the same tokens twice: the fraction is unchanged)
    return {l: float(counts[l, 0] / counts[l, 1]) for l in range(num_layers) if counts[l, 1] > 0}


def token_disagreement(replayer: RouterReplayer) -> float:
    """Fraction of routed tokens where the router's own top-k differs from the replayed route in at least one MoE
    layer, over the whole global batch and every pipeline stage's layers (collective over the world)."""
    from megatron.core import parallel_state as ps

    flags = replayer.pop_token_flags()
    stages: list = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, flags, group=ps.get_pipeline_model_parallel_group())
    stages = [f for f in stages if f is not None]               # the same tokens in the same order on every stage
    if not stages:
        return 0.0                                              # no MoE layer measured anywhere
    if len({f.numel() for f in stages}) != 1:
        raise AssertionError(f"pipeline stages measured different token counts: {[f.numel() for f in stages]}")
    any_layer = torch.stack(stages).any(0)
    counts = torch.tensor([float(any_layer.sum()), float(any_layer.numel())], dtype=torch.float64)
    if ps.get_pipeline_model_parallel_rank() != 0:
        counts.zero_()                  # one stage counts; DP ranks add other samples, SP ranks other positions
    dist.all_reduce(counts)             # (TP ranks without sequence parallelism count the same tokens twice)
    return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0


def gather_recorded(replayer: RouterReplayer, microbatches: list[list[int]], lengths: list[int], padded_len: int,
                    view: StageView) -> RoutesBatch:
    """R2: the routes this pass recorded on every rank, as one RoutesBatch in the capture format (collective)."""
    recorded = replayer.pop_recorded()          # per stage layer: one [local_tokens, k] per microbatch
    pieces = []
    for layer, per_mb in zip(replayer.layer_ids, recorded):
        if len(per_mb) != len(microbatches):
            raise AssertionError(f"layer {layer}: {len(per_mb)} recorded routes for {len(microbatches)} microbatches")
        for ids, idx in zip(microbatches, per_mb):
            lo, grid = unalign_microbatch(idx.cpu(), len(ids), padded_len=padded_len, **view.sp)
            for b, s in enumerate(ids):
                n = max(0, min(lengths[s] - 1, lo + grid.shape[0]) - lo)
                if n:
                    pieces.append((layer, s, lo, grid[:n, b].numpy().astype(np.int64)))
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, pieces)
    col = {l: c for c, l in enumerate(view.moe_layers)}
    samples = [np.full((n - 1, len(view.moe_layers), view.topk), -1, dtype=np.int64) for n in lengths]
    for part in everything:
        for layer, s, lo, arr in part:
            samples[s][lo:lo + arr.shape[0], col[layer]] = arr
    for s, arr in enumerate(samples):
        if (arr < 0).any():
            raise AssertionError(f"sample {s}: recorded routes incomplete after gathering every rank")
    return RoutesBatch(samples, view.moe_layers, view.num_experts, view.topk)
