"""The transports: each implements the Transport protocol (interface.py) against one kind of engine, and pushes
through TransportBase.push (versioned, checksummed, staged; only the commit switches what the engine serves).

    InprocTransport         colocated vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): tensors by reference
    HttpTransport           a separate vLLM OpenAI server started with our worker extension: /collective_rpc
    ShmTransport            the same server on this host: buckets in shared-memory segments, the RPC carries
                            handle, version and checksum only
    CudaIpcTransport        GPU engines: vLLM's weight-transfer engines (NCCL / CUDA IPC); not available on CPU

The full-weight reload with the adapters merged (MergedInprocTransport) is the refit's own (refit/merged.py).
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import torch

from .interface import PushResult, RefitError, TransportBase
from .wire import checksum, encode_blob


class InprocTransport(TransportBase):
    """vLLM LLM object in this process; collective_rpc hands the tensors to the worker without copies."""

    def __init__(self, llm):
        self.llm = llm

    def call(self, method: str, *args):
        try:
            return self.llm.collective_rpc(method, args=args)[0]
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - engine failure, not a user error
            raise RefitError(f"{method} failed in the engine: {e}") from e

    def send_bucket(self, version: int, index: int, tensors: dict):
        self.call("moe_lora_bucket", version, index, tensors)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class HttpTransport(TransportBase):
    """A vLLM server (VLLM_SERVER_DEV_MODE=1, --worker-extension-cls moe_lora_rl.vllm.worker_ext....)."""

    def __init__(self, base_url: str, timeout: float = 120.0, token: str | None = None):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}   # our engine server's shared secret

    def call(self, method: str, *args):
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

    def send_bucket(self, version: int, index: int, tensors: dict):
        self.call("moe_lora_bucket_blob", version, index, encode_blob(tensors))

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(f"{self.base_url}/reset_prefix_cache", data=b"", method="POST",
                                     headers=self.headers)
        try:
            urllib.request.urlopen(req, timeout=self.timeout).close()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise RefitError(f"version committed, but the prefix cache reset failed: {e}") from e


class ShmTransport(HttpTransport):
    """A vLLM server process on this host: the adapter is written to a private shared-memory segment (transfer/shm.py)
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
        served = self.call("moe_lora_push_shm", version, digest, rank, alpha, handle, shm.entries_of(tensors),
                            os.getpid())
        t2 = time.perf_counter()
        self.reset_prefix_cache()
        self.last_timing = {"write_s": t1 - t0, "rpc_s": t2 - t1, "reset_s": time.perf_counter() - t2}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return PushResult(version, nbytes, time.perf_counter() - t0, served)

    def send_bucket(self, version: int, index: int, tensors: dict):
        """Buckets of push_stream (several senders): one segment per bucket; the server copies it before the
        call returns, so the pool's segment of that size is reused by the next bucket."""
        from . import shm

        handle, digest = self.pool.write(tensors, version, index)
        self.call("moe_lora_bucket_shm", version, index, handle, shm.entries_of(tensors), digest)


class CudaIpcTransport(TransportBase):
    """GPU engines on this host: the same staged, versioned push with buckets as CUDA IPC handles, in the update
    format of vLLM's IPC weight-transfer engine (vllm.distributed.weight_transfer.ipc_engine, unpacked mode:
    names, dtype_names, shapes, one {gpu uuid: reduce_tensor args} per tensor). vLLM's engine would load_weights
    them into the base model; our worker rebuilds them into the adapter staging instead
    (moe_lora_bucket_ipc) and the commit validates the whole adapter. The sender keeps the tensors alive until the
    commit. CUDA only: on a CPU host it refuses up front (use ShmTransport)."""

    def __init__(self, llm):
        if not torch.cuda.is_available():
            raise RefitError("CudaIpcTransport needs CUDA (CUDA IPC handles); use ShmTransport on a CPU host")
        self.llm, self.alive = llm, []               # the GPU copies of this push, kept to its end

    def call(self, method: str, *args):
        return InprocTransport.call(self, method, *args)

    def push(self, version: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> PushResult:
        try:
            return super().push(version, tensors, rank, alpha)
        finally:
            self.alive = []

    def send_bucket(self, version: int, index: int, tensors: dict):
        from torch.multiprocessing.reductions import reduce_tensor

        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        info = {"names": [], "dtype_names": [], "shapes": [], "ipc_handles": []}
        for name, t in tensors.items():
            w = t.detach().cuda().contiguous()
            self.alive.append(w)                  # reduce_tensor's args do not keep the storage alive
            info["names"].append(name)
            info["dtype_names"].append(str(w.dtype).split(".")[-1])
            info["shapes"].append(list(w.shape))
            info["ipc_handles"].append({uuid: reduce_tensor(w)[1]})
        self.call("moe_lora_bucket_ipc", version, index, info, checksum(tensors))

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()
