"""The streaming push of a sharded Megatron model's adapters through a Transport (transfer/interface.py):

    gather TP/ETP -> collect EP/PP (gather.py) -> each bucket's PEFT tensors -> transport.send_bucket -> commit

    push_stream(model, arch, transport, version, rank, alpha)     # collective: every rank calls it
"""
from __future__ import annotations

import time

from ..transfer.interface import BUCKET_BYTES, PushResult, Transport
from ..transfer.wire import unpack


def push_stream(model, arch, transport: "Transport | None", version: int, rank: int, alpha: float,
                bucket_bytes: int = BUCKET_BYTES, collect_to: int | None = 0,
                owner: str | None = None, prepared=None) -> PushResult | None:
    """Collective: a streaming push from a sharded Megatron model (gather.py). collect_to=R: rank R holds
    the transport (e.g. an in-process engine) and receives every bucket; collect_to=None: every rank holds a
    transport to the same engine (e.g. HttpTransport) and sends its own buckets. The checksum travels with the
    commit, after the last bucket. owner: the policy whose version this is, when several share the engine.
    prepared: gather.prepare's stream of this model, kept by the caller across pushes (None: planned here, a
    collective of every rank's factor metadata). Returns the result on the committing rank."""
    import torch.distributed as dist

    from .gather import prepare, stream

    lead = 0 if collect_to is None else collect_to
    me = dist.get_rank()
    prepared = prepare(model, arch, bucket_bytes) if prepared is None else prepared
    plan = prepared.plan
    if plan.bucket_bytes != bucket_bytes:
        raise ValueError(f"the prepared stream has {plan.bucket_bytes}-byte buckets, not bucket_bytes={bucket_bytes}")
    t0 = time.perf_counter()
    began: list = [None]
    if me == lead:
        try:
            transport.call("moe_lora_begin", version, None, rank, alpha, len(plan.buckets),
                           *(() if owner is None else (None, owner)))
        except Exception as e:  # noqa: BLE001 - every rank must learn it, or the others wait in the stream
            began[0] = e
    dist.broadcast_object_list(began, src=lead)
    if began[0] is not None:
        raise began[0]
    digest = stream(model, arch, plan, lambda b, buf: transport.send_bucket(version, b.index,
                                                                          unpack(buf, b.entries())), collect_to,
                    prepared.params)
    dist.barrier()
    if me != lead:
        return None
    served = transport.call("moe_lora_commit", version, digest)
    transport.reset_prefix_cache()
    return PushResult(version, plan.total_bytes, time.perf_counter() - t0, served)
