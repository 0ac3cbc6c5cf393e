"""A checkpoint-engine backend ("moe_lora") for verl's non-colocated and async modes, delivering our engine's
adapter stream (weight_sync.py) into each rollout server's worker extension as one staged version. Two deliveries:

    mailbox (default; verl's CheckpointEngineManager: one-step-off and fully-async trainers)
      send_weights(stream) on the trainer's rank 0: header + adapters (host copies) -> a named Ray actor (mailbox.py)
      receive_weights() on each rollout worker: the newest item it has not delivered yet -> header + adapters, which
        verl's ServerAdapter.update_weights streams to our extension's update_weights_from_ipc (staged, checksum
        checked, the previous version served until the commit; the base stays the one the server loaded)
    server_urls (engine_kwargs.moe_lora.server_urls, or `transports` set by the caller): send_weights pushes
      moe_lora_begin / bucket ... / commit(checksum) to each server itself; receive_weights yields nothing

"moe_lora_base" (MoELoRABaseCheckpointEngine, push delivery) sends the base too, for servers started empty.

verl's own backends drop peft_config here, so adapters never reach the engine; this one needs no peft_config (the
header says version, checksum, rank and alpha). Select it with rollout.checkpoint_engine.backend=moe_lora and
rollout.checkpoint_engine.custom_backend_module=moe_lora_rl.integration.verl.plugin. engine_kwargs.moe_lora.sync_log:
a JSON-lines file where the trainer records each version sent (and the servers what they serve after it, replica.py).
"""
from __future__ import annotations

from typing import Any

from verl.checkpoint_engine.base import CheckpointEngine

from .weight_sync import META, decode_meta

BACKEND = "moe_lora"
BASE_BACKEND = "moe_lora_base"


def trainer_lead() -> bool:
    """True on the trainer's rank 0 (or outside a process group): the one rank that delivers a version here. Every
    rank's stream carries the whole version (weight_sync.py), so the others only drain theirs."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def split_buckets(tensors: dict, bucket_bytes: int) -> list[dict]:
    buckets, cur, size = [], {}, 0
    for n, t in tensors.items():
        nb = t.numel() * t.element_size()
        if cur and size + nb > bucket_bytes:
            buckets.append(cur)
            cur, size = {}, 0
        cur[n] = t
        size += nb
    if cur:
        buckets.append(cur)
    return buckets


def split_stream(weights) -> tuple[dict, dict, dict]:
    """(header, base tensors, adapter tensors) from our engine's stream (base tensors only where the header says
    base); a stream that does not start with our header is an error."""
    it = iter(weights)
    first = next(it, None)
    if first is None:
        return {}, {}, {}
    name, t = first
    if name != META:
        raise ValueError(f"weight stream starts with {name!r}, not {META!r}: it does not come from our engine "
                         "(actor_rollout_ref.actor.megatron._target_ must be our engine config)")
    meta, base, adapters = decode_meta(t), {}, {}
    for n, x in it:
        (adapters if ".lora_" in n else base)[n] = x
    return meta, base, adapters


def read_stream(weights) -> tuple[dict, dict]:
    """(header, adapter tensors) from our engine's stream; base tensors are skipped (the server loads the base from
    the same checkpoint)."""
    meta, _, adapters = split_stream(weights)
    return meta, adapters


class MoELoRACheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int = 64 << 20, server_urls: list[str] | None = None, sync_log: str | None = None,
                 mailbox_timeout_s: float = 600.0, **_: Any):
        from ...transfer.transports import HttpTransport

        self.bucket_size = bucket_size
        self.transports = [HttpTransport(u) for u in (server_urls or [])]
        self.sync_log, self.mailbox_timeout_s = sync_log, float(mailbox_timeout_s)
        self.delivered = 0                      # the mailbox sequence number this receiver delivered last
        self.last: dict | None = None

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        return {"rank": list(range(actor_wg_world_size))}, {"rank": list(range(rollout_world_size))}

    def init_process_group(self, **kwargs):
        return None

    def finalize(self):
        return None

    async def send_weights(self, weights, global_steps: int | None = None):
        if not trainer_lead():                 # the trainer's rank 0 delivers the version, once: the others leave
            return {}                          # their streams unread (no base read from the checkpoint files)
        meta, tensors = read_stream(weights)
        if not meta:
            return {}
        if not self.transports:
            return await self._post(meta, tensors, global_steps)
        return self._push(meta, tensors)

    async def _post(self, meta: dict, tensors: dict, global_steps: int | None, base: dict | None = None) -> dict:
        """Mailbox delivery: host copies of the adapters, and of the base when given ("moe_lora_base"), each owning
        exactly its bytes (transfer/wire.owned)."""
        from ...transfer.wire import owned
        from .mailbox import post

        # owned: the adapters are views of the gather's buckets, and Ray pickles a view with its whole storage
        seq = await post(meta, owned(tensors), owned(base) if base else None)
        with_base = {"base_tensors": len(base)} if base else {}
        self.last = {"version": meta["version"], "tensors": len(tensors), "seq": seq, **with_base}
        log_sync(self.sync_log, {"side": "trainer", "version": meta["version"], "checksum": meta["checksum"],
                                 "global_steps": global_steps, "seq": seq, **({"base": True} if base else {})})
        return {"moe_lora/refit_version": meta["version"], "moe_lora/refit_tensors": len(tensors),
                **({"moe_lora/base_version": seq, "moe_lora/base_tensors": len(base)} if base else {})}

    def _push(self, meta: dict, tensors: dict) -> dict:
        """The adapters to every server as one staged version (server_urls delivery)."""
        buckets = split_buckets(tensors, self.bucket_size)
        served = []
        for tr in self.transports:
            tr.call("moe_lora_begin", meta["version"], meta["checksum"], meta["rank"], meta["alpha"], len(buckets))
            for i, b in enumerate(buckets):
                tr.send_bucket(meta["version"], i, b)
            served.append(tr.call("moe_lora_commit", meta["version"], meta["checksum"]))
            tr.reset_prefix_cache()
        self.last = {"version": meta["version"], "tensors": len(tensors), "buckets": len(buckets), "served": served}
        return {"moe_lora/refit_version": meta["version"], "moe_lora/refit_tensors": len(tensors)}

    async def receive_weights(self, global_steps: int | None = None):
        """Mailbox delivery: the header (the base stays: loaded by the server from the checkpoint) and the adapters
        of the newest version posted since this receiver's last delivery. Push delivery: nothing (the extension
        already committed the version through its RPCs)."""
        if self.transports:
            return
        from .mailbox import take
        from .weight_sync import encode_meta

        seq, meta, tensors, _ = await take(self.delivered, self.mailbox_timeout_s)
        self.delivered = seq
        yield META, encode_meta({**meta, "base": False, "base_from_checkpoint": True})
        for item in tensors.items():
            yield item


class MoELoRABaseCheckpointEngine(MoELoRACheckpointEngine):
    """Backend "moe_lora_base": the base weights too, for rollout servers started empty (rollout.load_format=dummy,
    no copy of the checkpoint on the rollout side). Later streams carry adapters only. Two deliveries, as "moe_lora":
    - mailbox (default): the first stream's base goes into the mailbox with its adapters and stays there; each
      receiver yields the base with the newest adapters until it has delivered that base (an engine started, or
      restarted, later gets it then), adapters only after. verl's ServerAdapter streams it to our extension, which
      loads the base in place (vLLM's layerwise reload) before it stages the adapters. A base posted again (a
      restarted trainer's first stream) goes only to receivers that have none: the base never trains.
    - push (engine_kwargs.moe_lora.server_urls, or `transports` set by the caller): the base reaches each server
      through vLLM's weight-transfer API (transfer/: one shared-memory store of buckets, each checked by its
      digest, or each bucket inline for a server on another host), then its adapters as "moe_lora" pushes them.
      engine_kwargs.moe_lora.base_transport: auto (shared memory to a server on loopback, the bytes inline in each
      call to one on another host), shm or http."""

    def __init__(self, bucket_size: int = 64 << 20, server_urls: list[str] | None = None, base_transport: str = "auto",
                 **kw: Any):
        if base_transport not in ("auto", "shm", "http"):
            raise ValueError(f"engine_kwargs.moe_lora.base_transport={base_transport!r}: expected auto, shm or http")
        super().__init__(bucket_size, server_urls, **kw)
        self.base_version, self.base_transport = 0, base_transport

    def transport_for(self, tr) -> str:
        """shm or http for one server: auto is shm for a server on loopback (or in this process), http otherwise."""
        if self.base_transport != "auto":
            return self.base_transport
        from urllib.parse import urlparse

        url = getattr(tr, "base_url", None)
        return "shm" if url is None or urlparse(url).hostname in ("127.0.0.1", "localhost", "::1") else "http"

    async def send_weights(self, weights, global_steps: int | None = None):
        from ...transfer.shm_sender import send_store
        from ...transfer.base_store import BaseStore

        if not trainer_lead():                 # the trainer's rank 0 delivers the version, once (streams unread)
            return {}
        meta, base, tensors = split_stream(weights)
        if not meta:
            return {}
        if not self.transports:
            return await self._post(meta, tensors, global_steps, base)
        out = {}
        if base:
            self.base_version += 1
            store = BaseStore(base, self.bucket_size, self.base_version)
            try:
                syncs = [send_store(tr.call, store, transport=self.transport_for(tr)) for tr in self.transports]
            finally:
                store.close()
            out = {"moe_lora/base_version": self.base_version, "moe_lora/base_tensors": len(base),
                   "moe_lora/base_sync_s": sum(t["total_s"] for t in syncs),
                   "moe_lora/base_transports": [t["transport"] for t in syncs]}
        return {**out, **self._push(meta, tensors)}

    async def receive_weights(self, global_steps: int | None = None):
        """Mailbox delivery: the header, the base (once per receiver) and the adapters of the newest version posted
        since this receiver's last delivery. Push delivery: nothing."""
        if self.transports:
            return
        from .mailbox import take
        from .weight_sync import encode_meta

        seq, meta, tensors, base = await take(self.delivered, self.mailbox_timeout_s, self.base_version)
        self.delivered = seq
        if base is not None:
            self.base_version = base[0]
        yield META, encode_meta({**meta, "base": base is not None, "base_delivered": self.base_version})
        for item in (*(base[1].items() if base is not None else ()), *tensors.items()):
            yield item


def log_sync(path: str | None, line: dict) -> None:
    if not path:
        return
    import json
    import os
    import time

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({**line, "time": time.time()}) + "\n")
