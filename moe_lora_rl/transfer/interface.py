"""The contract between a sender and one rollout engine (or several), and the staged push written on it.

Every transport, and every wrapper stacked around one (rl/survivor.py, rl/served.py, rollout/replicas.FanOut, the
engine client's transports in rollout/client.py, tests/kit/fakes.FakeEngine), implements `Transport` by these three
names. An adapter push is versioned and checksummed; the engine stages the buckets and only the commit switches what
it serves, so generation continues during a push and a failed push leaves the previous complete version serving:

    t.call("moe_lora_begin", version, checksum | None, rank, alpha, num_buckets[, sender_pid, owner])
    t.send_bucket(version, index, {peft name: tensor})        # each bucket once, index 0 .. num_buckets - 1
    served = t.call("moe_lora_commit", version[, checksum])   # the engine's status: the version it now serves
    t.reset_prefix_cache()                                    # no KV block computed under the old weights reused

TransportBase.push runs these for tensors held in this process; refit/push.push_stream runs them from a sharded
Megatron model (every rank streams its buckets, one rank commits). The full-weight sync (shm_sender.py,
gloo_sender.py) drives vLLM's weight-transfer calls of the engine through `call` alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .push_plan import plan_buckets
from .wire import combine, tensor_crc

BUCKET_BYTES = 64 << 20           # bytes of tensors per bucket of a push (the last bucket may hold fewer)


class RefitError(RuntimeError):
    """The engine did not take the push (unreachable, died, or failed); it still serves its previous version."""


@dataclass
class PushResult:
    version: int
    bytes: int                    # bytes of tensors pushed (numel x element size, summed; no wire overhead)
    seconds: float                # wall seconds from the plan to the prefix cache reset
    served: dict                  # the engine's answer to the commit (its status: "version", "checksum", ...)


@runtime_checkable
class Transport(Protocol):
    """What a sender needs of an engine. Errors: ValueError when the engine answered and refused (a bad argument, a
    stale or duplicate version, a checksum that does not match; it keeps serving its previous version), RefitError
    when it could not be reached or failed (the engine client raises rollout.client.EngineDied, a RefitError's
    sibling, when its process is gone)."""

    def call(self, method: str, *args) -> Any:
        """Run the worker extension's method `method` (vllm/worker_ext.py: moe_lora_begin, moe_lora_commit,
        moe_lora_abort, moe_lora_status, moe_lora_base_*, and vLLM's weight-transfer calls) on the engine with
        positional `args` (JSON values over HTTP; tensors too in process); returns the first worker's answer."""

    def send_bucket(self, version: int, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """Stage bucket `index` (0-based, below the begin's num_buckets) of `version`, begun by this sender:
        PEFT tensor name -> tensor (any shape and dtype). An engine in this process may hold the tensors by
        reference until the commit: the caller does not write into them meanwhile."""

    def reset_prefix_cache(self) -> None:
        """After a commit: KV blocks cached under the previous weights are dropped. RefitError when it fails (the
        version is committed all the same)."""


class TransportBase:
    """push, status and abort written on the three Transport methods; a transport class adds call and send_bucket
    (and reset_prefix_cache where its engine caches prefixes: a no-op here)."""

    bucket_bytes = BUCKET_BYTES

    def push(self, version: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> PushResult:
        """The whole adapter (PEFT name -> tensor, held in this process) as `version`, in buckets of at most
        bucket_bytes; rank and alpha: the LoRA rank and alpha the engine scales by (alpha / rank). A bucket that
        fails aborts the stage (the engine accepts the next push) and its error is raised."""
        plan = plan_buckets(version, {k: v.numel() * v.element_size() for k, v in tensors.items()},
                            self.bucket_bytes)
        t0 = time.perf_counter()
        crcs = {n: tensor_crc(n, t) for n, t in tensors.items()}
        self.call("moe_lora_begin", version, combine(crcs), rank, alpha, len(plan.buckets))
        try:
            for b in plan.buckets:
                self.send_bucket(version, b.index, {n: tensors[n] for n in b.names})
        except BaseException:
            self.abort(version)
            raise
        served = self.call("moe_lora_commit", version)      # closes the stage, whether it succeeds or not
        self.reset_prefix_cache()
        return PushResult(version, plan.total_bytes, time.perf_counter() - t0, served)

    def status(self) -> dict:
        """The engine's served adapter: "version" (None: the base model), "checksum", "num_tensors", "mode", ..."""
        return self.call("moe_lora_status")

    def abort(self, version: int) -> None:
        """Best effort after a failed bucket: drop our stage of `version` so the engine accepts the next push; the
        bucket's error is the one raised."""
        try:
            self.call("moe_lora_abort", version)
        except Exception:  # noqa: BLE001 - the engine may be gone; the stage then goes with it
            pass

    def reset_prefix_cache(self) -> None:
        """KV blocks cached under the previous weights must not be reused after a commit (no cache: nothing)."""
