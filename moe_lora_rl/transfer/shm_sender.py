"""The sending side of a full-weight sync to one engine: a BaseStore (base_store.py: the bucket plan's buckets in
segments) sent through vLLM's weight-transfer calls of the engine (vllm/base_sync.py), over shared memory (one host:
the engine maps the segments) or inline (transport http: each bucket's bytes inside its call, inline.py, for an
engine on another host).

    moe_lora_base_init -> start_weight_update -> update_weights(bucket i) ... -> finish_weight_update

The engine maps each bucket and checks its digest where it lies. A store's buckets are written on first use, bucket
i+1 while the engine reads bucket i; a store already written (an engine restarted or added) is sent without a copy.
On any error the engine's open update is aborted (moe_lora_base_abort): it keeps its previous weights. Timers per
phase: init (our backend made the worker's weight-transfer engine), copy (buckets written into the store during this sync, with their digests), transport (the engine's map and
check of each bucket, through the RPCs), load (the engine's finish: the bytes checked again, loaded into the model).

    timers = send_store(rpc, store)                        # rpc(method, *args) -> the workers' answers
    timers = send_store(rpc, store, transport="http")      # the same buckets, their bytes in the calls
    timers = send_base(rpc, tensors, version=1, size=64 << 20)     # a store made for this sync and removed after
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .base_store import BaseStore


def checkpoint_tensors(model_dir) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory by name (the base a trainer holds and sends), read through
    models/checkpoint.py's reader (sharded checkpoints included)."""
    from pathlib import Path

    from ..models.checkpoint import HFCheckpoint

    if not sorted(Path(model_dir).glob("*.safetensors")):
        raise ValueError(f"{model_dir}: no *.safetensors files to send")
    ck = HFCheckpoint(model_dir)
    return {name: ck.get(name) for name in ck.weight_map}


TRANSPORTS = ("shm", "http", "ipc")


def _check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"base transport {transport!r}: expected one of {TRANSPORTS}")


def send_store(rpc, store: BaseStore, keep: bool = False, transport: str = "shm") -> dict:
    """The store's base into the engine as its version (keep: the engine keeps the bytes for a peer); the timers
    (copy_s: the store's writes during this sync, with the base64 encoding for http). ipc (GPU, an engine on this
    process's GPU): each bucket copied from the store to this process's device and handed over as a CUDA IPC
    handle (cuda_ipc.py); the last two stay alive, the engine having copied each before the next but one is made."""
    from collections import deque

    from .inline import encode_inline

    _check_transport(transport)
    if transport == "ipc" and not torch.cuda.is_available():
        raise ValueError("base transport 'ipc' needs CUDA in this process (CUDA IPC handles); use shm on CPU")
    alive: deque = deque(maxlen=2)
    written_s, before = store.write_s, store.written()
    encode = [0.0]

    def inline(i):
        info, data = store.info(i), store.data(i)
        t0 = time.perf_counter()
        out = encode_inline(info, data)
        encode[0] += time.perf_counter() - t0
        return out

    def ipc(i):
        from .cuda_ipc import share

        info, data = store.info(i), store.data(i)
        t0 = time.perf_counter()
        dev = data.to(torch.device("cuda", torch.cuda.current_device()))
        alive.append(dev)
        encode[0] += time.perf_counter() - t0
        return {**info, "handle": share(dev), "transport": "ipc"}

    timers = _send(rpc, len(store.buckets), {"shm": store.info, "http": inline, "ipc": ipc}[transport], keep)
    alive.clear()
    timers["transport"] = transport
    timers.update(bytes=store.nbytes, written_before=before, copy_s=store.write_s - written_s + encode[0])
    return timers


def send_from_peer(rpc, peer_rpc, bucket_bytes: int, keep: bool = True, transport: str = "shm") -> dict:
    """The base a live peer engine keeps (the checkpoint bytes it was synced with) into the engine, which started
    empty and keeps it in turn: the peer writes each bucket when it is asked for it (between its own engine steps),
    the engine maps and checks it (http: the peer answers with the bucket's bytes, passed on in the engine's call:
    the two engines need not share a host with each other or with this process); the timers (copy_s: the peer's
    writes). The peer's export is closed whatever happens."""
    _check_transport(transport)
    try:
        t0 = time.perf_counter()
        head = peer_rpc("moe_lora_base_export_begin", int(bucket_bytes))
        begin_s = time.perf_counter() - t0
        copy = [0.0]

        def bucket(i):
            t = time.perf_counter()
            info = peer_rpc("moe_lora_base_export_bucket", i, transport == "http")
            copy[0] += time.perf_counter() - t
            return info

        timers = _send(rpc, head["buckets"], bucket, keep)
        timers.update(bytes=head["bytes"], version=head["version"], copy_s=copy[0], begin_s=begin_s,
                      transport=transport)
        return timers
    finally:
        try:
            peer_rpc("moe_lora_base_export_end")
        except Exception:  # noqa: BLE001 - the sync's own error (or result) is the one to report
            pass


def _send(rpc, n: int, bucket, keep: bool) -> dict:
    """start, update_weights(bucket(i)) for i < n (bucket i+1 made while the engine reads bucket i), finish."""
    timers = {"copy_s": 0.0, "transport_s": 0.0, "load_s": 0.0, "buckets": n}
    t_all = time.perf_counter()
    try:
        rpc("moe_lora_base_init", bool(keep))
        t_move = time.perf_counter()
        timers["init_s"] = t_move - t_all              # the backend made the worker's engine (once per process)
        rpc("start_weight_update")
        with ThreadPoolExecutor(1, thread_name_prefix="bucket-write") as ahead:
            nxt = ahead.submit(bucket, 0) if n else None
            for i in range(n):
                info = nxt.result()
                nxt = ahead.submit(bucket, i + 1) if i + 1 < n else None
                t0 = time.perf_counter()
                rpc("update_weights", info)
                timers["transport_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        timers["move_s"] = t0 - t_move                 # start and every bucket (the writes overlapping the reads)
        rpc("finish_weight_update")
        timers["load_s"] = time.perf_counter() - t0
    except BaseException:
        try:
            rpc("moe_lora_base_abort")
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        raise
    timers["total_s"] = time.perf_counter() - t_all
    return timers


def send_base(rpc, tensors: dict[str, torch.Tensor], version: int, size: int, transport: str = "shm") -> dict:
    """Every tensor to the engine as base `version`, in buckets of at most `size` bytes, through a store made for
    this sync; the timers."""
    store = BaseStore(tensors, size, version)
    try:
        return send_store(rpc, store, transport=transport)
    finally:
        store.close()
