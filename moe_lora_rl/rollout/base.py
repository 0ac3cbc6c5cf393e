"""How the base reaches rollout engines that start empty (rollout.base_from=trainer|peer): the transport for each
engine by where it runs, and the thin movers over transfer/ (the trainer's store, a live peer's kept copy).

    rollout.base_transport   auto: shm for an engine on this host, http for one on another host
                             shm:  the engine maps the store's shared-memory segments (this host only)
                             http: each bucket's bytes inside its call (transfer/inline.py), any host
                             gloo: one broadcast to every engine at once (transfer/gloo_sender.py), any host
                             nccl: the same broadcast over NCCL from this process's CUDA device to GPU engines
                                   (refused without CUDA; not run on the CPU machines that test this project)
                             ipc:  each bucket as a CUDA IPC handle on this process's GPU, for an engine on the
                                   same GPU (colocated; refused without CUDA; not run here either)

    resolve_peer_transport(s, p, q)    shm or http for a peer join between engines placed at p and q
    check_base_transport(...)          at construction: the refusals, one line naming the setting
    sync_base(engine)                  the trainer's store into one engine (a start or a restart)
    broadcast_base(engines, store)     gloo: the store into every engine at once (Replicas.start)
    sync_from_peer(engine)             a live peer's kept base into a restarted engine (base_from=peer): over shared
                                       memory when both run here, else inline through this process
"""
from __future__ import annotations

from .guard import DEFAULT_MAX_BODY
from .placement import Placement

BASE_TRANSPORTS = ("auto", "shm", "http", "gloo", "nccl", "ipc")
GROUP_TRANSPORTS = ("gloo", "nccl")         # one broadcast to every engine at once


def resolve_transport(setting: str, placement: Placement) -> str:
    """shm, http or gloo for an engine placed there (auto: shm on this host, http on another)."""
    if setting == "auto":
        return "shm" if placement.transport == "shm" else "http"
    return setting


def resolve_peer_transport(setting: str, placement: Placement, peer: Placement) -> str:
    """A peer join (base_from=peer): shm when this process and both engines share a host and the setting is not
    http, else http (inline through this process)."""
    return "shm" if setting != "http" and placement.transport == "shm" and peer.transport == "shm" else "http"


def check_base_transport(base_from: str, transport: str, bucket_mb: float, placement: Placement,
                         max_body_mb: float | None) -> None:
    """ValueError naming the setting when the base cannot travel that way to an engine placed there."""
    if transport not in BASE_TRANSPORTS:
        raise ValueError(f"base_transport={transport!r}: expected one of {BASE_TRANSPORTS}")
    if base_from == "disk":
        return
    if transport in ("nccl", "ipc") and not placement.env.get("CUDA_VISIBLE_DEVICES"):
        raise ValueError(f"base_transport={transport!r} for an engine given no GPU (rollout.gpus is empty): "
                         f"{transport.upper()} moves device memory (use gloo, http or shm on CPU)")
    if transport in ("shm", "ipc") and placement.transport != "shm":
        raise ValueError(f"base_transport={transport!r} for an engine on {placement.connect_host}: "
                         f"{'shared memory' if transport == 'shm' else 'a CUDA IPC handle'} reaches engines on this "
                         "host only (use http or gloo, or auto)")
    if resolve_transport(transport, placement) == "http":
        limit = max_body_mb if max_body_mb is not None else DEFAULT_MAX_BODY / (1 << 20)
        need = bucket_mb * 4 / 3 + 1                 # base64 and the call around it
        if need > limit:
            raise ValueError(f"base_bucket_mb={bucket_mb:g}: a bucket sent inline over http takes about {need:.0f} "
                             f"MiB of request body, over the engine's limit of {limit:g} MiB (max_body_mb)")


def gloo_host(placements) -> str:
    """Where the engines reach this process's gloo store: loopback when they all run here, else this host's name
    (the store listens on every interface; its key, handed over each engine's authenticated RPC, guards it)."""
    import socket

    return "127.0.0.1" if all(p.transport == "shm" for p in placements) else socket.gethostname()


def base_store_of(model_dir, bucket_mb: float):
    """The checkpoint's tensors (the trainer's base) as a BaseStore (transfer/base_store.py) of buckets of bucket_mb."""
    from ..transfer.shm_sender import checkpoint_tensors
    from ..transfer.base_store import BaseStore

    return BaseStore(checkpoint_tensors(model_dir), int(bucket_mb * (1 << 20)), version=1)


def sync_base(engine) -> dict:
    """The checkpoint this process holds (the trainer's base) into the engine, which started empty, through vLLM's
    weight-transfer calls over its transport; the timers. The base is read and written into shared memory once
    (transfer/base_store.py); a restarted engine is sent the same buckets."""
    if engine.base_store is None:
        engine.base_store = base_store_of(engine.model_dir, engine.settings["base_bucket_mb"])
    keep = engine.settings["base_from"] == "peer"
    transport = engine.base_transport()
    if transport in GROUP_TRANSPORTS:
        t = broadcast_base([engine], engine.base_store, transport)
    else:
        from ..transfer.shm_sender import send_store

        t = send_store(engine.transport.call, engine.base_store, keep=keep, transport=transport)
        engine.base_syncs.append(t)
    return t


def broadcast_base(engines: list, store, backend: str = "gloo") -> dict:
    """The store into every engine at once over one gloo (or nccl) group (each keeps the bytes under
    base_from=peer); the timers, recorded as each engine's sync."""
    from ..transfer.gloo_sender import GlooBroadcast

    keep = engines[0].settings["base_from"] == "peer"
    with GlooBroadcast([e.transport.call for e in engines], host=gloo_host([e.placement for e in engines]),
                       keep=keep, backend=backend) as cast:
        t = {**cast.send(store), "transport": backend, "group_s": cast.init_s}
    for e in engines:
        e.base_syncs.append(t)
    return t


def sync_from_peer(engine) -> dict:
    """The base a live peer engine keeps (the checkpoint bytes it was synced with) into this engine, which started
    empty and keeps it in turn: the first live peer that gives it; the timers, with the peer's port. Over shared
    memory when this process and both engines share a host (and the setting is not http), else inline through this
    process. ValueError when no peer is alive, or naming the last refusal when none gives it."""
    from ..transfer.shm_sender import send_from_peer

    live = [p for p in engine.peers() if p is not engine and p.alive()]
    if not live:
        raise ValueError(f"base_from=peer: no live peer engine to take the base from (engine on port "
                         f"{engine.port}, {len(engine.peers())} peers)")
    for k, peer in enumerate(live):
        try:
            t = send_from_peer(engine.transport.call, peer.transport.call,
                               int(engine.settings["base_bucket_mb"] * (1 << 20)),
                               transport=resolve_peer_transport(engine.settings["base_transport"], engine.placement,
                                                                peer.placement))
        except ValueError:
            if k == len(live) - 1:
                raise
            continue                     # this peer keeps no base (or refused a bucket): the next one
        t["peer_port"] = peer.port
        engine.base_syncs.append(t)
        return t
