"""vLLM worker extension (worker_extension_cls="moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension"): adapter
pushes reach the worker through collective_rpc, in process or over the server's /collective_rpc endpoint.

vLLM 0.32 mixes the extension into its worker class as an extra base and never calls its __init__, so the first
moe_lora_* call is the hook (entry.py): every entry point checks the vLLM version first (ValueError, nothing changed)
and then applies our fixes to vLLM once per worker process (reload_fix) and to its loaded model once per worker
(rope_fix); make_engine calls moe_lora_prepare right after the engine is built, so they are in place before any
request. Here: adapter pushes (one-shot, staged, shared memory, CUDA IPC), request versions and route capture; the
base weights' entries and a peer's base export are base_entries.py's, mixed in.

Engine settings come from vLLM's additional_config: moe_lora_serving ("unmerged" | "merged"), moe_lora_inflight
("switch" | "pin"), moe_lora_max_versions, moe_lora_on_full ("wait" | "refuse"); checked by
versions.check_inflight_config on the first moe_lora_* call that needs them. With pin, the engine loop tracks each
request's version before adding it (moe_lora_track) and releases it when it ended (moe_lora_release).
moe_lora_stage_timeout_s (default staged_push.DEFAULT_STAGE_TIMEOUT_S): an open stage with no begin or bucket for that
long is aborted by the engine (moe_lora_expire, called periodically by the engine server, or the next begin), with
one line in the engine's log.
"""
from __future__ import annotations

import torch

from ..transfer.wire import decode_blob
from .adapter_set import build_adapter_set
from .base_entries import BaseWeightEntries
from .entry import ensure_model_ready, entry

class MoELoRAWorkerExtension(BaseWeightEntries):
    def _moe_lora_config(self) -> dict:
        """The engine's moe_lora_* settings, checked (ValueError naming a bad value)."""
        from .versions import check_inflight_config

        extra = getattr(self.vllm_config, "additional_config", None) or {}
        cfg = {"mode": extra.get("moe_lora_serving", "unmerged"), "inflight": extra.get("moe_lora_inflight", "switch"),
               "max_versions": extra.get("moe_lora_max_versions"), "on_full": extra.get("moe_lora_on_full", "wait"),
               "expert_precision": extra.get("moe_lora_expert_precision", "serving")}
        check_inflight_config(cfg["mode"], cfg["inflight"], cfg["max_versions"], cfg["on_full"])
        return cfg

    def _moe_lora_runtime(self):
        rt = getattr(self, "_moe_lora_rt", None)
        if rt is None:
            from .runtime import LoRARuntime
            from .step_hooks import add_listener

            rt = LoRARuntime(self.model_runner.model, self.model_config.model, dtype=self.model_config.dtype,
                             **self._moe_lora_config())
            if rt.table.pin:                      # switch: every token runs on the newest version, no plan needed
                add_listener(self.model_runner, rt)
            self._moe_lora_rt = rt
        return rt

    def _moe_lora_salt(self, internal_request_id: str) -> str:
        """A request's cache salt, for the prefix route store (the untracked salt before any adapter call)."""
        from .versions import UNTRACKED_SALT

        rt = getattr(self, "_moe_lora_rt", None)
        return UNTRACKED_SALT if rt is None else rt.salt(internal_request_id)

    def _moe_lora_new_weights(self) -> None:
        """The held versions changed: prefix routes of versions no longer held (and untracked ones) are stale."""
        cap = getattr(self, "_moe_lora_capture", None)
        if cap is not None:
            cap.new_weights(self._moe_lora_runtime().live_salts())

    @entry
    def moe_lora_prepare(self) -> dict:
        """Apply the fixes (version check, reload_fix, rope_fix) before the first request: make_engine calls it on
        every engine it builds. Returns what the model fixes changed."""
        return dict(ensure_model_ready(self))

    @entry
    def moe_lora_push(self, version: int, checksum: str, tensors: dict, rank: int, alpha: float) -> dict:
        """A complete adapter in one call: the staging rules hold (refused while another version is staged), then
        it is validated and served; on any error the previous version stays."""
        return self._moe_lora_one_shot(version, checksum, rank, alpha, lambda: tensors)

    def _moe_lora_one_shot(self, version, checksum, rank, alpha, read, sender_pid=None, verified=False) -> dict:
        staging = self._moe_lora_staging()
        self._moe_lora_begin(version, checksum, rank, alpha, 1, sender_pid)
        try:
            staging.bucket(version, 0, read())
        except BaseException:
            staging.abort(version)
            raise
        st = staging.commit(version)
        return self._moe_lora_activate(version, st.checksum, st.tensors, st.rank, st.alpha, verified)

    def _moe_lora_activate(self, version, checksum, tensors, rank, alpha, verified=False, owner=None) -> dict:
        """Validate a complete adapter and make it the served version (of policy `owner`); on any error the
        previous one stays."""
        import time

        rt = self._moe_lora_runtime()
        rt.table.plan_admit(version, owner)            # stale, or pin and full: refused before validating
        t0 = time.perf_counter()
        adapter = build_adapter_set(tensors, rt.arch, rank=rank, alpha=alpha, version=version,
                                    expected_checksum=checksum, dtype=torch.float32, checksum_verified=verified)
        timing = {"validate_s": time.perf_counter() - t0, **rt.activate(adapter, owner)}
        self._moe_lora_new_weights()
        return {**rt.status(), **timing}

    @entry
    def moe_lora_set_mode(self, mode: str) -> dict:
        """Serving mode of expert adapters ("merged" / "unmerged"); only while no adapter is served."""
        rt = self._moe_lora_runtime()
        rt.set_mode(mode)
        return rt.status()

    # staged push: begin -> bucket* -> commit; serving is untouched until commit validates the whole adapter
    def _moe_lora_staging(self):
        st = getattr(self, "_moe_lora_stage", None)
        if st is None:
            from .staged_push import DEFAULT_STAGE_TIMEOUT_S, Staging

            extra = getattr(self.vllm_config, "additional_config", None) or {}
            timeout = extra.get("moe_lora_stage_timeout_s", DEFAULT_STAGE_TIMEOUT_S)
            st = self._moe_lora_stage = Staging(timeout_s=timeout, on_expire=self._moe_lora_log_expiry)
        return st

    def _moe_lora_log_expiry(self, stage, idle_s: float) -> None:
        served = self._moe_lora_runtime().status()["version"]
        print(f"moe_lora: stage of adapter version {stage.version} expired: no progress for {idle_s:.1f} s "
              f"(stage_timeout_s {self._moe_lora_staging().timeout_s:g}, {len(stage.buckets)}/{stage.num_buckets} "
              f"buckets received); aborted, version {served} stays served", flush=True)

    def _moe_lora_begin(self, version, checksum, rank, alpha, num_buckets, sender_pid, owner=None) -> dict:
        staging = self._moe_lora_staging()
        staging.expire()                      # an abandoned stage is logged and dropped before this push is judged
        rt = self._moe_lora_runtime()
        served = rt.status()["version"]
        if isinstance(version, int) and (served is None or version > served):
            rt.table.check_unused(version)        # a number passed before a clear: refused before any bucket
        return staging.begin(version, checksum, rank, alpha, num_buckets, served=served, sender_pid=sender_pid,
                             owner=owner)

    @entry
    def moe_lora_begin(self, version: int, checksum: str, rank: int, alpha: float, num_buckets: int,
                       sender_pid: int | None = None, owner: str | None = None) -> dict:
        """Open the stage of `version`; refused while another version's push is in flight (vllm/staged_push.py).
        sender_pid: a sender on this host, whose stage may be replaced once that process is gone. owner: the
        policy whose version it is, when several share the engine (vllm/versions.py)."""
        return self._moe_lora_begin(version, checksum, rank, alpha, num_buckets, sender_pid, owner)

    @entry
    def moe_lora_expire(self) -> dict:
        """Abort the open stage, and an open base update, if it made no progress for stage_timeout_s (logged); the
        served versions are untouched. Called between engine steps by the engine server, so an abandoned stage goes
        without a new push."""
        from .base_sync import engine_class

        eng = getattr(self, "weight_transfer_engine", None)
        base = eng is not None and type(eng) is engine_class() and self._moe_lora_base_expire(eng)
        return {"expired": self._moe_lora_staging().expire(), "base_expired": base}

    @entry
    def moe_lora_bucket(self, version: int, index: int, tensors: dict) -> dict:
        return self._moe_lora_staging().bucket(version, index, tensors)

    @entry
    def moe_lora_abort(self, version: int) -> dict:
        """Drop the staged `version` (its sender gave up); the served version is untouched."""
        return self._moe_lora_staging().abort(version)

    @entry
    def moe_lora_bucket_blob(self, version: int, index: int, blob_b64: str) -> dict:
        return self.moe_lora_bucket(version, index, decode_blob(blob_b64))

    def _moe_lora_recv(self):
        """Receive buffers of shared-memory pushes (transfer/shm.py); segments of dead senders removed once."""
        bufs = getattr(self, "_moe_lora_recv_bufs", None)
        if bufs is None:
            from ..transfer import shm

            shm.remove_stale()
            bufs = self._moe_lora_recv_bufs = shm.RecvBuffers()
        return bufs

    @entry
    def moe_lora_bucket_shm(self, version: int, index: int, handle: str, entries: list, crc: str) -> dict:
        """A bucket in a shared-memory segment of a process on this host (transfer/shm.py): copied out, checked against
        its segment digest `crc`, staged (the adapter digest is checked at the commit); the sender may reuse the
        segment once this call returned."""
        from ..transfer import shm

        return self.moe_lora_bucket(version, index, shm.read_segment(handle, entries, crc,
                                                                     buffers=self._moe_lora_recv()))

    @entry
    def moe_lora_push_shm(self, version: int, checksum: str, rank: int, alpha: float, handle: str, entries: list,
                          sender_pid: int | None = None) -> dict:
        """A whole adapter in one shared-memory segment, in one RPC: begin, the segment copied out and checked
        against `checksum`, its segment digest (wire.segment_digest: the bytes are hashed once per side; it is the
        served version's checksum), commit. Same staging rules as a bucketed push: refused while another version is
        staged; on any error the stage is closed and the previous version stays served. The sender may reuse the
        segment once this call returned."""
        import time

        from ..transfer import shm

        t = {}

        def read():
            t0 = time.perf_counter()
            tensors = shm.read_segment(handle, entries, checksum, buffers=self._moe_lora_recv())
            t["shm_read_s"] = time.perf_counter() - t0
            return tensors

        return {**self._moe_lora_one_shot(version, checksum, rank, alpha, read, sender_pid, verified=True), **t}

    @entry
    def moe_lora_bucket_ipc(self, version: int, index: int, info: dict, crc: str) -> dict:
        """A bucket as CUDA IPC handles in the unpacked update format of vLLM's IPC weight-transfer engine; copied
        to this worker's device before staging (the sender frees its tensors after the commit)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        from ..transfer.wire import checksum as crc_of

        dev = torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(dev).uuid)
        tensors = {}
        for name, handles in zip(info["names"], info["ipc_handles"]):
            if uuid not in handles:
                raise ValueError(f"bucket {index}: no IPC handle for GPU {uuid} (have {sorted(handles)})")
            args = list(handles[uuid])
            args[6] = dev
            tensors[name] = rebuild_cuda_tensor(*args).clone()
        got = crc_of(tensors)
        if got != crc:
            raise ValueError(f"version {version} bucket {index}: checksum mismatch (sent {crc}, received {got})")
        return self.moe_lora_bucket(version, index, tensors)

    @entry
    def moe_lora_commit(self, version: int, checksum: str | None = None) -> dict:
        """checksum: when the senders could only compute it after streaming (begin was given None)."""
        st = self._moe_lora_staging().commit(version, checksum)
        return self._moe_lora_activate(version, st.checksum, st.tensors, st.rank, st.alpha, owner=st.owner)

    @entry
    def moe_lora_push_blob(self, version: int, checksum: str, blob_b64: str, rank: int, alpha: float) -> dict:
        return self.moe_lora_push(version, checksum, decode_blob(blob_b64), rank, alpha)

    @entry
    def moe_lora_status(self) -> dict:
        """version (the newest held), checksum, num_tensors, mode; inflight, max_versions, on_full, versions (held,
        sorted), requests_per_version ({str(version): tracked requests}, "None" for the base model), can_commit (a
        newer version fits now); staged (the open stage's version or None), stage_idle_s, stage_timeout_s,
        stages_expired."""
        st = self._moe_lora_staging()
        return {**self._moe_lora_runtime().status(), "staged": st.version, "stage_idle_s": st.idle_s(),
                "stage_timeout_s": st.timeout_s, "stages_expired": st.expired}

    @entry
    def moe_lora_clear(self) -> dict:
        """Serve the base model; with pin, refused while requests run on a held version."""
        rt = self._moe_lora_runtime()
        rt.deactivate()
        self._moe_lora_new_weights()
        return rt.status()

    # request versions (versions.py): tracked before the engine loop adds a request, released when it ended
    @entry
    def moe_lora_track(self, requests: list) -> list:
        """[[request id, version | None], ...] -> the version each runs on (None asks for the newest held one;
        pin: an explicit version must be held; switch: only the newest); all or nothing."""
        return self._moe_lora_runtime().track(requests)

    @entry
    def moe_lora_release(self, request_ids: list) -> dict:
        """The requests ended (finished or aborted); pin frees every held version, other than the newest, that no
        tracked request runs on. Unknown ids are ignored."""
        freed = self._moe_lora_runtime().release(request_ids)
        if freed:
            self._moe_lora_new_weights()
        return {"freed": freed}

    # routing capture for router replay
    @entry
    def moe_lora_capture_start(self) -> dict:
        from .capture import RouteCapture

        cap = getattr(self, "_moe_lora_capture", None)
        if cap is None:
            self._moe_lora_config()
            cap = self._moe_lora_capture = RouteCapture(self.model_runner, salt_of=self._moe_lora_salt)
            cap.start()
        return cap.meta()

    @entry
    def moe_lora_capture_pop(self, request_ids: list, wire: bool = False) -> dict:
        """wire=True: each request's routes as [dtype, shape, bytes] (what crosses an engine-core process intact;
        vLLM's utility-result codec does not rebuild arrays nested in a dict)."""
        cap = getattr(self, "_moe_lora_capture", None)
        if cap is None:
            raise ValueError("routing capture was not started (moe_lora_capture_start)")
        out = cap.pop(request_ids)
        if wire:
            return {rid: [r.dtype.str, list(r.shape), r.tobytes()] for rid, r in out.items()}
        return out

    @entry
    def moe_lora_capture_discard(self, request_ids: list) -> dict:
        cap = getattr(self, "_moe_lora_capture", None)
        return {"discarded": cap.discard(request_ids) if cap is not None else 0}

    @entry
    def moe_lora_capture_stop(self) -> dict:
        cap = getattr(self, "_moe_lora_capture", None)
        if cap is not None:
            cap.stop()
            self._moe_lora_capture = None
        return {"stopped": True}
