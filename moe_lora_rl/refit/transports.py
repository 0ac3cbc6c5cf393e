"""Movers: execute a RefitPlan against one kind of engine. Each push is versioned and checksummed; the engine
stages buckets and only the final commit switches what it serves, so generation continues during a push and a
failed push leaves the previous complete version serving.

    InprocTransport         colocated vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): tensors by reference
    HttpTransport           a separate vLLM OpenAI server started with our worker extension: /collective_rpc
    ShmTransport            the same server on this host: buckets in shared-memory segments, the RPC carries
                            handle, version and checksum only
    CudaIpcTransport        GPU engines: vLLM's weight-transfer engines (NCCL / CUDA IPC); not available on CPU
    MergedInprocTransport   full-weight refit (adapters merged into every weight) through reload_weights
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import torch

from .plan import plan_buckets
from .wire import checksum, combine, encode_blob, tensor_crc

BUCKET_BYTES = 64 << 20


class RefitError(RuntimeError):
    """The engine did not take the push (unreachable, died, or refused); it still serves its previous version."""


@dataclass
class PushResult:
    version: int
    bytes: int
    seconds: float
    served: dict


class _Base:
    bucket_bytes = BUCKET_BYTES

    def push(self, version: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> PushResult:
        plan = plan_buckets(version, {k: v.numel() * v.element_size() for k, v in tensors.items()},
                            self.bucket_bytes)
        t0 = time.perf_counter()
        self._crcs = {n: tensor_crc(n, t) for n, t in tensors.items()}      # once: digest and bucket CRCs
        digest = combine(self._crcs)
        self._call("moe_lora_begin", version, digest, rank, alpha, len(plan.buckets))
        try:
            for b in plan.buckets:
                self._send_bucket(version, b.index, {n: tensors[n] for n in b.names})
        except BaseException:
            self._abort(version)
            raise
        served = self._call("moe_lora_commit", version)      # closes the stage, whether it succeeds or not
        self._reset_prefix_cache()
        return PushResult(version, plan.total_bytes, time.perf_counter() - t0, served)

    def status(self) -> dict:
        return self._call("moe_lora_status")

    def _abort(self, version: int) -> None:
        """Best effort after a failed bucket: drop our stage so the engine accepts the next push; the bucket's
        error is the one raised."""
        try:
            self._call("moe_lora_abort", version)
        except Exception:  # noqa: BLE001 - the engine may be gone; the stage then goes with it
            pass

    def _reset_prefix_cache(self) -> None:
        """KV blocks cached under the previous weights must not be reused after a commit."""


def push_stream(model, arch, transport: "_Base | None", version: int, rank: int, alpha: float,
                bucket_bytes: int = BUCKET_BYTES, collect_to: int | None = 0,
                owner: str | None = None, prepared=None) -> PushResult | None:
    """Collective: a streaming push from a sharded Megatron model (refit/gather.py). collect_to=R: rank R holds
    the transport (e.g. an in-process engine) and receives every bucket; collect_to=None: every rank holds a
    transport to the same engine (e.g. HttpTransport) and sends its own buckets. The checksum travels with the
    commit, after the last bucket. owner: the policy whose version this is, when several share the engine.
    prepared: gather.prepare's stream of this model, kept by the caller across pushes (None: planned here, a
    collective of every rank's factor metadata). Returns the result on the committing rank."""
    import torch.distributed as dist

    from .gather import prepare, stream
    from .wire import unpack

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
            transport._call("moe_lora_begin", version, None, rank, alpha, len(plan.buckets),
                            *(() if owner is None else (None, owner)))
        except Exception as e:  # noqa: BLE001 - every rank must learn it, or the others wait in the stream
            began[0] = e
    dist.broadcast_object_list(began, src=lead)
    if began[0] is not None:
        raise began[0]
    digest = stream(model, arch, plan, lambda b, buf: transport._send_bucket(version, b.index,
                                                                           unpack(buf, b.entries())), collect_to,
                    prepared.params)
    dist.barrier()
    if me != lead:
        return None
    served = transport._call("moe_lora_commit", version, digest)
    transport._reset_prefix_cache()
    return PushResult(version, plan.total_bytes, time.perf_counter() - t0, served)


class InprocTransport(_Base):
    """vLLM LLM object in this process; collective_rpc hands the tensors to the worker without copies."""

    def __init__(self, llm):
        self.llm = llm

    def _call(self, method: str, *args):
        try:
            return self.llm.collective_rpc(method, args=args)[0]
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - engine failure, not a user error
            raise RefitError(f"{method} failed in the engine: {e}") from e

    def _send_bucket(self, version: int, index: int, tensors: dict):
        self._call("moe_lora_bucket", version, index, tensors)

    def _reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class HttpTransport(_Base):
    """A vLLM server (VLLM_SERVER_DEV_MODE=1, --worker-extension-cls moe_lora_rl.vllm.worker_ext....)."""

    def __init__(self, base_url: str, timeout: float = 120.0, token: str | None = None):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}   # our engine server's shared secret

    def _call(self, method: str, *args):
        body = json.dumps({"method": method, "args": list(args)}).encode()
        req = urllib.request.Request(f"{self.base_url}/collective_rpc", data=body,
                                     headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                payload = json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if "collective_rpc method failed" in detail:   # the engine answered: our method refused the push
                try:
                    detail = json.loads(detail)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                raise ValueError(f"engine refused {method}: {detail}") from e
            raise RefitError(f"{method}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise RefitError(f"{method}: engine at {self.base_url} unreachable: {e}") from e
        results = payload.get("results", payload)
        return results[0] if isinstance(results, list) else results

    def _send_bucket(self, version: int, index: int, tensors: dict):
        self._call("moe_lora_bucket_blob", version, index, encode_blob(tensors))

    def _reset_prefix_cache(self) -> None:
        req = urllib.request.Request(f"{self.base_url}/reset_prefix_cache", data=b"", method="POST",
                                     headers=self.headers)
        try:
            urllib.request.urlopen(req, timeout=self.timeout).close()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise RefitError(f"version committed, but the prefix cache reset failed: {e}") from e


class ShmTransport(HttpTransport):
    """A vLLM server process on this host: the adapter is written to a private shared-memory segment (refit/shm.py)
    and /collective_rpc carries its handle, entries and digest. push: one segment and one RPC; push_stream: one
    segment per bucket. The segments are a pool reused across pushes (renamed per push: a handle is valid for one
    push); close() removes them (also done at exit; segments of dead processes are removed when a transport or a
    server starts)."""

    def __init__(self, base_url: str, timeout: float = 120.0, token: str | None = None):
        from . import shm

        super().__init__(base_url, timeout, token)
        shm.remove_stale()
        self.pool = shm.SegmentPool()

    def close(self) -> None:
        self.pool.close()

    def push(self, version: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> PushResult:
        """The whole adapter in one segment and one RPC (moe_lora_push_shm): the segment digest is computed over the
        bytes written, the server checks it over its copy; the RPC returns after the commit."""
        import os

        from . import shm

        t0 = time.perf_counter()
        handle, digest = self.pool.write(tensors, version, 0)
        t1 = time.perf_counter()
        served = self._call("moe_lora_push_shm", version, digest, rank, alpha, handle, shm.entries_of(tensors),
                            os.getpid())
        t2 = time.perf_counter()
        self._reset_prefix_cache()
        self.last_timing = {"write_s": t1 - t0, "rpc_s": t2 - t1, "reset_s": time.perf_counter() - t2}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return PushResult(version, nbytes, time.perf_counter() - t0, served)

    def _send_bucket(self, version: int, index: int, tensors: dict):
        """Buckets of push_stream (several senders): one segment per bucket; the server copies it before the
        call returns, so the pool's segment of that size is reused by the next bucket."""
        from . import shm

        handle, digest = self.pool.write(tensors, version, index)
        self._call("moe_lora_bucket_shm", version, index, handle, shm.entries_of(tensors), digest)


class CudaIpcTransport(_Base):
    """GPU engines on this host: the same staged, versioned push with buckets as CUDA IPC handles, in the update
    format of vLLM's IPC weight-transfer engine (vllm.distributed.weight_transfer.ipc_engine, unpacked mode:
    names, dtype_names, shapes, one {gpu uuid: reduce_tensor args} per tensor). vLLM's engine would load_weights
    them into the base model; our worker rebuilds them into the adapter staging instead
    (moe_lora_bucket_ipc) and the commit validates the whole adapter. The sender keeps the tensors alive until the
    commit. CUDA only: on a CPU host it refuses up front (use ShmTransport)."""

    def __init__(self, llm):
        if not torch.cuda.is_available():
            raise RefitError("CudaIpcTransport needs CUDA (CUDA IPC handles); use ShmTransport on a CPU host")
        self.llm, self._alive = llm, []

    def _call(self, method: str, *args):
        return InprocTransport._call(self, method, *args)

    def push(self, version: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> PushResult:
        try:
            return super().push(version, tensors, rank, alpha)
        finally:
            self._alive = []

    def _send_bucket(self, version: int, index: int, tensors: dict):
        from torch.multiprocessing.reductions import reduce_tensor

        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        info = {"names": [], "dtype_names": [], "shapes": [], "ipc_handles": []}
        for name, t in tensors.items():
            w = t.detach().cuda().contiguous()
            self._alive.append(w)                  # reduce_tensor's args do not keep the storage alive
            info["names"].append(name)
            info["dtype_names"].append(str(w.dtype).split(".")[-1])
            info["shapes"].append(list(w.shape))
            info["ipc_handles"].append({uuid: reduce_tensor(w)[1]})
        self._call("moe_lora_bucket_ipc", version, index, info, checksum(tensors))

    def _reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class MergedInprocTransport:
    """Same push(version, tensors, rank, alpha) interface; moves the whole model with the adapters merged."""

    def __init__(self, llm, model_dir: str):
        self.llm, self.model_dir, self.version = llm, model_dir, None

    def push(self, version: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> PushResult:
        from .merged import merged_state

        if self.version is not None and version <= self.version:
            raise ValueError(f"stale weight version {version}: version {self.version} is served")
        t0 = time.perf_counter()
        weights = merged_state(self.model_dir, tensors, alpha / rank)
        try:
            self.llm.collective_rpc("moe_lora_clear")            # the merged weights already hold the adapter
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()
        except Exception as e:  # noqa: BLE001
            raise RefitError(f"full-weight reload failed: {e}") from e
        self.version = version
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        return PushResult(version, nbytes, time.perf_counter() - t0, {"version": version})

    def status(self) -> dict:
        return {"version": self.version}
