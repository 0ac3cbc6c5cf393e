"""The sending side of a full-weight sync over shared memory (one host): the bucket plan (buckets.py) executed into
shared-memory segments, each bucket sent through vLLM's weight-transfer calls of the engine (vllm/base_sync.py).

    moe_lora_base_init -> start_weight_update -> update_weights(bucket i) ... -> finish_weight_update

Double-buffered: two segment pools take turns, so bucket i+1 is copied (and its digest computed) while the engine
reads bucket i. On any error the engine's open update is aborted (moe_lora_base_abort): it keeps its previous
weights. Timers per phase: copy (into the segment, with the digest), transport (the engine's read and check of each
bucket), load (the engine's finish: pieces put together, weights loaded).

    timers = send_base(rpc, tensors, version=1, size=64 << 20)    # rpc(method, *args) -> the workers' answers
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .buckets import Bucket, TensorMeta, plan


def checkpoint_tensors(model_dir) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory by name (the base a trainer holds and sends), read through
    models/checkpoint.py's reader (sharded checkpoints included)."""
    from pathlib import Path

    from ..models.checkpoint import HFCheckpoint

    if not sorted(Path(model_dir).glob("*.safetensors")):
        raise ValueError(f"{model_dir}: no *.safetensors files to send")
    ck = HFCheckpoint(model_dir)
    return {name: ck.get(name) for name in ck.weight_map}


def metas_of(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def bucket_tensors(bucket: Bucket, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list]:
    """A bucket's pieces as uint8 views of the tensors' bytes (keyed name@part) and their descriptions
    [name, dtype, shape, start, nbytes, part, parts] for the receiver."""
    out, pieces = {}, []
    for p in bucket.pieces:
        t = tensors[p.name].detach().contiguous().cpu()
        out[f"{p.name}@{p.part}"] = t.reshape(-1).view(torch.uint8)[p.start:p.start + p.nbytes]
        pieces.append([p.name, str(p.dtype).removeprefix("torch."), list(p.shape), p.start, p.nbytes, p.part,
                       p.parts])
    return out, pieces


def send_base(rpc, tensors: dict[str, torch.Tensor], version: int, size: int) -> dict:
    """Every tensor to the engine as base `version`, in buckets of at most `size` bytes; the timers."""
    from ..refit.shm import SegmentPool, entries_of

    buckets = plan(metas_of(tensors), size)
    pools = (SegmentPool(), SegmentPool())
    timers = {"copy_s": 0.0, "transport_s": 0.0, "load_s": 0.0, "buckets": len(buckets),
              "bytes": sum(b.nbytes for b in buckets)}

    def write(i: int):
        t0 = time.perf_counter()
        data, pieces = bucket_tensors(buckets[i], tensors)
        handle, digest = pools[i % 2].write(data, version, i)
        timers["copy_s"] += time.perf_counter() - t0
        return {"version": version, "buckets": len(buckets), "index": i, "handle": handle,
                "entries": entries_of(data), "digest": digest, "pieces": pieces}

    t_all = time.perf_counter()
    try:
        rpc("moe_lora_base_init")
        rpc("start_weight_update")
        with ThreadPoolExecutor(1, thread_name_prefix="bucket-copy") as ahead:
            nxt = ahead.submit(write, 0) if buckets else None
            for i in range(len(buckets)):
                info = nxt.result()
                nxt = ahead.submit(write, i + 1) if i + 1 < len(buckets) else None
                t0 = time.perf_counter()
                rpc("update_weights", info)
                timers["transport_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        timers["move_s"] = t0 - t_all                  # init, start and every bucket (copies overlapping reads)
        rpc("finish_weight_update")
        timers["load_s"] = time.perf_counter() - t0
    except BaseException:
        try:
            rpc("moe_lora_base_abort")
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        raise
    finally:
        for p in pools:
            p.close()
    timers["total_s"] = time.perf_counter() - t_all
    return timers
