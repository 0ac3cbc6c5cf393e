"""Streaming adapter gather: the refit plan executed bucket by bucket, each tensor assembled only on the rank that
sends it.

    report factors (metadata only) -> plan (stream_plan.py) -> per bucket: the sender allocates the bucket buffer,
    writes its own shard and each TP/ETP peer's shard (point-to-point, one shard at a time) into the PEFT tensors'
    places -> the consumer gets the buffer (the sender itself, or one collecting rank) -> buffer freed

EP and PP ranks send the experts and layers they own; DP/EDP replicas and EP copies of shared factors send
nothing. Extra memory on a rank at any moment: one bucket buffer plus one received shard. Every rank of the world
walks the same bucket order, so the point-to-point pairs always match.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..lora.grad_sync import process_group
from ..lora.layers import adapter_factors
from ..lora.state import is_owner
from ..models.arch import MoEArch
from ..transfer.wire import buffer_crcs, combine, unpack
from .rename import place
from .stream_plan import DTYPE, FactorReport, StreamBucket, StreamPlan, expected_factors, plan_stream


def _members(group: str | None) -> tuple[int, ...]:
    if group is None:
        return (dist.get_rank(),)
    g = process_group(group)
    return tuple(dist.get_global_rank(g, i) for i in range(dist.get_world_size(g)))


def local_reports(model) -> tuple[list[FactorReport], dict[str, torch.nn.Parameter]]:
    """This rank's factors: those of the replica set that sends (rank 0 of every group the factor is replicated
    over); the sender is the gather group's first rank."""
    reports, params = [], {}
    for _, p in adapter_factors(model):
        meta = p.lora_meta
        if not is_owner(meta):
            continue
        members = _members(meta.group if meta.shard_dim is not None else None)
        reports.append(FactorReport(meta.global_name, tuple(meta.global_shape), meta.shard_dim, members,
                                    members[0] == dist.get_rank()))
        params[meta.global_name] = p
    return reports, params


@dataclass(frozen=True)
class Prepared:
    """A model's stream, planned once: the plan (the same on every rank) and this rank's factors by global name.
    Valid for as long as the model keeps its adapter parameters (their values may change: they are read at
    send time)."""
    plan: StreamPlan
    params: dict


def prepare(model, arch: MoEArch, bucket_bytes: int) -> Prepared:
    """Collective: every rank's factor metadata (names and shapes, no tensors) -> the same plan on every rank."""
    reports, params = local_reports(model)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, reports)
    return Prepared(plan_stream(everyone, arch, bucket_bytes, expected_factors(arch, model.lora_config)), params)


def build_plan(model, arch: MoEArch, bucket_bytes: int) -> StreamPlan:
    """Collective: prepare's plan."""
    return prepare(model, arch, bucket_bytes).plan


@torch.no_grad()
def _assemble(bucket: StreamBucket, params: dict, arch: MoEArch) -> torch.Tensor | None:
    """This rank's part in assembling one bucket: the sender returns the filled buffer, its TP/ETP peers send
    their shards to it (one shard at a time) and return None."""
    me = dist.get_rank()
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8) if bucket.sender == me else None
    views = unpack(buf, bucket.entries()) if buf is not None else None
    for u in bucket.units:
        if me not in u.members:
            continue
        local = params[u.factor]
        shard = local.lora_meta.canonical(local.detach()).to(DTYPE)
        if me != u.sender:
            dist.send(shard.contiguous(), dst=u.sender)
            continue
        for i, src in enumerate(u.members):
            part = shard
            if src != me:
                part = torch.empty(shard.shape, dtype=DTYPE)
                dist.recv(part, src=src)
            for o in u.outputs:
                for region, piece in place(o, part, i, len(u.members), u.shard_dim, arch):
                    views[o.name][region] = piece
    return buf


def stream_buckets(model, plan: StreamPlan, arch: MoEArch, collect_to: int | None = None, params: dict | None = None
                   ) -> Iterator[tuple[StreamBucket, torch.Tensor]]:
    """Collective. Yields (bucket, flat uint8 buffer) on the rank that consumes it: the bucket's sender, or
    `collect_to` (which receives every bucket). Drop the buffer before asking for the next bucket: this generator
    holds no reference to it across the yield (no torch.no_grad around a yield: its wrapper keeps the last
    value alive until the next one exists). params: Prepared.params (None: read from the model)."""
    me = dist.get_rank()
    params = local_reports(model)[1] if params is None else params
    for bucket in plan.buckets:
        buf = _assemble(bucket, params, arch)
        if collect_to is not None and collect_to != bucket.sender:
            if me == bucket.sender:
                dist.send(buf, dst=collect_to)
                buf = None
            elif me == collect_to:
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
                dist.recv(buf, src=bucket.sender)
        if buf is not None:
            out, buf = (bucket, buf), None
            yield out
            out = None


def stream_buckets_to_all(model, plan: StreamPlan, arch: MoEArch, params: dict | None = None
                          ) -> Iterator[tuple[StreamBucket, torch.Tensor]]:
    """Collective. Yields every (bucket, flat uint8 buffer) on every rank: each bucket assembled on its sender, then
    broadcast from it (verl's colocated weight sync hands each trainer rank's stream to its own rollout worker, so
    every rank streams the whole adapter version). The same buffers, in the same order, on every rank."""
    me = dist.get_rank()
    params = local_reports(model)[1] if params is None else params
    for bucket in plan.buckets:
        buf = _assemble(bucket, params, arch)
        if me != bucket.sender:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        dist.broadcast(buf, src=bucket.sender)
        out, buf = (bucket, buf), None
        yield out
        out = None


def stream(model, arch: MoEArch, plan: StreamPlan, consume: Callable[[StreamBucket, torch.Tensor], None],
           collect_to: int | None = None, params: dict | None = None) -> str:
    """Collective: hand every bucket's buffer to `consume` on its consuming rank (`wire.unpack(buf,
    bucket.entries())` gives its PEFT tensors as views). Returns the adapter checksum (transfer/wire.py), the same on
    every rank."""
    crcs: dict[str, int] = {}
    for bucket, buf in stream_buckets(model, plan, arch, collect_to, params):
        crcs.update(buffer_crcs(buf, bucket.entries()))
        consume(bucket, buf)
        del buf
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, crcs)
    return combine({n: c for part in everyone for n, c in part.items()})
