"""A checkpoint-engine backend ("moe_lora") for verl's non-colocated and async modes, delivering our engine's
adapter stream (weight_sync.py) into each rollout server's worker extension as one staged version:

    send_weights(stream) on the trainer: header -> adapters -> moe_lora_begin / bucket ... / commit(checksum)
    receive_weights() on the rollout side yields nothing: the extension already holds the committed version

verl's own backends drop peft_config here, so adapters never reach the engine; this one needs no peft_config (the
header says version, checksum, rank and alpha). Select it with rollout.checkpoint_engine.backend=moe_lora and
rollout.checkpoint_engine.custom_backend_module=moe_lora_rl.integration.verl.plugin; the server URLs come from
rollout.checkpoint_engine.engine_kwargs.moe_lora.server_urls (or are set by the caller as `transports`).
"""
from __future__ import annotations

from typing import Any

from verl.checkpoint_engine.base import CheckpointEngine

from .weight_sync import META, decode_meta

BACKEND = "moe_lora"


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


def read_stream(weights) -> tuple[dict, dict]:
    """(header, adapter tensors) from our engine's stream; base tensors are skipped (the server loads the base from
    the same checkpoint), anything else is an error."""
    it = iter(weights)
    first = next(it, None)
    if first is None:
        return {}, {}
    name, t = first
    if name != META:
        raise ValueError(f"weight stream starts with {name!r}, not {META!r}: it does not come from our engine "
                         "(actor_rollout_ref.actor.megatron._target_ must be our engine config)")
    meta = decode_meta(t)
    tensors = {n: x for n, x in it if ".lora_" in n}
    return meta, tensors


class MoELoRACheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int = 64 << 20, server_urls: list[str] | None = None, **_: Any):
        from ...refit.transports import HttpTransport

        self.bucket_size = bucket_size
        self.transports = [HttpTransport(u) for u in (server_urls or [])]
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
        meta, tensors = read_stream(weights)
        if not meta:                           # ranks other than the trainer's rank 0 send nothing
            return {}
        if not self.transports:
            raise ValueError("rollout.checkpoint_engine.engine_kwargs.moe_lora.server_urls is empty: no rollout "
                             "server to deliver the adapters to")
        buckets = split_buckets(tensors, self.bucket_size)
        served = []
        for tr in self.transports:
            tr._call("moe_lora_begin", meta["version"], meta["checksum"], meta["rank"], meta["alpha"], len(buckets))
            for i, b in enumerate(buckets):
                tr._send_bucket(meta["version"], i, b)
            served.append(tr._call("moe_lora_commit", meta["version"], meta["checksum"]))
            tr._reset_prefix_cache()
        self.last = {"version": meta["version"], "tensors": len(tensors), "buckets": len(buckets), "served": served}
        return {"moe_lora/refit_version": meta["version"], "moe_lora/refit_tensors": len(tensors)}

    async def receive_weights(self, global_steps: int | None = None):
        return
        yield  # an empty async generator: the worker extension received the adapters through its RPCs
