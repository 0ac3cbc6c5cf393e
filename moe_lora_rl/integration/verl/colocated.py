"""What the rollout side does with one colocated weight sync (verl's update_weights_from_ipc), as a pure state
machine over the received buckets; vllm_extension.py moves the bytes and applies the result.

verl's colocated sync sends our engine's stream (weight_sync.py) in buckets, each a list of (name, tensor) views
into a reused buffer, the last one flagged:

    bucket 0 starts with ("moe_lora.meta", header)   version, checksum, rank, alpha, base
    base weights (HF names)                           only when the header says base: handed out per bucket, loaded
    adapters (PEFT names, ".lora_" in them)           cloned and kept until the last bucket, then staged as one version

Our checkpoint-engine backends' streams say base_from_checkpoint ("moe_lora": the server loaded the base itself) or
base_delivered ("moe_lora_base" after this server's base went out): adapters only, whatever verl's base_sync_done. verl calls it twice on the first colocated sync (base_sync_done=False, then True)
with the same adapter version; a repeat of the served version with the same checksum is a no-op, with another
checksum an error (two different adapters under one version number).
"""
from __future__ import annotations

from .weight_sync import META, decode_meta


class ColocatedSync:
    def __init__(self, base_sync_done: bool):
        self.base_sync_done = bool(base_sync_done)
        self.meta: dict | None = None
        self.adapters: dict = {}
        self.base_count = 0
        self.done = False

    def bucket(self, weights: list, is_last: bool) -> list:
        """Feed one bucket; returns the base (name, tensor) pairs of it to load now (views into the buffer)."""
        if self.done:
            raise ValueError("weight sync: a bucket arrived after the last one")
        base = []
        for name, t in weights:
            if self.meta is None:
                if name != META:
                    raise ValueError(f"weight stream starts with {name!r}, not {META!r}: it does not come from our "
                                     "engine (actor_rollout_ref.actor.megatron._target_ must be our engine config)")
                self.meta = decode_meta(t)
                if not self.base_sync_done and not any(self.meta.get(k) for k in
                                                       ("base", "base_from_checkpoint", "base_delivered")):
                    raise ValueError(f"verl asked for a base weight sync (base_sync_done=False) but the stream of "
                                     f"version {self.meta.get('version')} carries no base weights")
                continue
            if name == META:
                raise ValueError("weight stream has a second header: two streams were interleaved")
            if ".lora_" in name:
                self.adapters[name] = t.clone()
            elif self.meta.get("base"):
                base.append((name, t))
                self.base_count += 1
            else:
                raise ValueError(f"weight stream of version {self.meta['version']} has a base tensor {name!r} but "
                                 "its header says adapters only")
        if is_last:
            if self.meta is None:
                raise ValueError("weight stream ended without its header: nothing was sent")
            self.done = True
        return base

    def plan(self, served: dict) -> str:
        """After the last bucket: "stage" the adapters as a new version, or "same" (this version is served)."""
        if not self.done:
            raise ValueError("weight sync: the stream has not ended (no last bucket)")
        v, c = self.meta["version"], self.meta["checksum"]
        if served.get("version") == v:
            if served.get("checksum") != c:
                raise ValueError(f"adapter version {v} is served with checksum {served.get('checksum')}, the stream "
                                 f"sends {c} under the same version: the trainer's versions went out of step")
            return "same"
        if not self.adapters:
            raise ValueError(f"weight stream of version {v} has no adapter tensors")
        return "stage"
