"""One engine without vLLM for checks of the push protocol and of request versions: the /collective_rpc methods of
our worker extension (vllm/worker_ext.py) that hold no vLLM state, served by the plugin's own pure parts, so the fake
answers what the engine answers:

    moe_lora_begin / bucket / commit / abort / expire   the staged push (vllm/staged_push.py); begin refuses a version
                                                         not newer than the served one, commit is admitted by the
                                                         version table before the adapter is validated
    moe_lora_track / release / clear / status            the request versions (vllm/versions.py's VersionTable)

The commit is validated by the engine's own adapter check (vllm/adapter_set.py, checksum included) when the model's
arch is given. Everything that needs vLLM (generation, routing capture, merged serving) is out of scope.

    FakeEngine()                   in memory: the transport and the engine in one process (rank 0 collects)
    FakeEngine(arch, folder=DIR)   every rank's sender reaches the same engine: buckets land as safetensors files
                                   in DIR, the committing rank reads them all
    FakeEngine(inflight="pin", max_versions=2)   the engine's version policy (its additional_config)
    engine.track([[rid, version | None], ...]) -> versions;  engine.release([rid, ...]) -> {"freed": [...]}
"""
from __future__ import annotations

from pathlib import Path

from moe_lora_rl.transfer.interface import TransportBase
from moe_lora_rl.vllm.staged_push import Staging
from moe_lora_rl.vllm.versions import VersionTable, check_inflight_config


class FakeEngine(TransportBase):
    def __init__(self, arch=None, folder: Path | None = None, bucket_bytes: int | None = None,
                 fail_bucket: int | None = None, *, inflight: str = "switch", max_versions: int | None = None,
                 on_full: str = "wait"):
        """fail_bucket: sending that bucket index raises ValueError("bucket lost") (set it to None to heal).
        inflight, max_versions, on_full: as the engine's moe_lora_inflight / _max_versions / _on_full."""
        self.arch, self.folder, self.fail_bucket, self.st, self.received = arch, folder, fail_bucket, Staging(), {}
        self.table = VersionTable(check_inflight_config("unmerged", inflight, max_versions, on_full))
        self.adapters: dict[int, dict] = {}           # held version -> {"tensors", "checksum", "num_tensors"}
        if bucket_bytes is not None:
            self.bucket_bytes = bucket_bytes

    # the client side: what rollout/loop.py asks the engine around each request's life
    def track(self, requests: list) -> list:
        """[[request id, version | None], ...] -> the version each runs on; all or nothing (moe_lora_track)."""
        return self.call("moe_lora_track", requests)

    def release(self, request_ids: list) -> dict:
        """The requests ended; {"freed": versions no longer held} (moe_lora_release; unknown ids are ignored)."""
        return self.call("moe_lora_release", request_ids)

    # the engine side: the worker extension's methods of the same names
    def call(self, method, *args):
        handler = getattr(self, "_rpc_" + method.removeprefix("moe_lora_"), None)
        if not method.startswith("moe_lora_") or handler is None:
            raise AssertionError(f"FakeEngine: no method {method!r}")
        return handler(*args)

    def _rpc_begin(self, version, checksum, rank, alpha, num_buckets, sender_pid=None, owner=None):
        self.st.expire()
        if isinstance(version, int) and (self.table.newest is None or version > self.table.newest):
            self.table.check_unused(version)          # as the worker extension: a number passed before a clear
        return self.st.begin(version, checksum, rank, alpha, num_buckets, served=self.table.newest,
                             sender_pid=sender_pid, owner=owner)

    def _rpc_abort(self, version):
        return self.st.abort(version)

    def _rpc_expire(self):
        return {"expired": self.st.expire()}

    def _rpc_commit(self, version, checksum=None):
        if self.folder is not None:
            from safetensors.torch import load_file

            for f in sorted(self.folder.glob(f"v{version}-*.safetensors")):
                self.st.bucket(version, int(f.stem.split("-")[1]), load_file(str(f)))
        stage = self.st.commit(version, checksum)       # closes the stage whether or not the activation succeeds
        self.table.plan_admit(version, stage.owner)     # stale, or pin and full: refused before validating
        held = {"tensors": stage.tensors, "checksum": stage.checksum, "num_tensors": len(stage.tensors)}
        if self.arch is not None:
            from moe_lora_rl.vllm.adapter_set import build_adapter_set

            a = build_adapter_set(stage.tensors, self.arch, rank=stage.rank, alpha=stage.alpha,
                                  version=stage.version, expected_checksum=stage.checksum)
            held.update(checksum=a.checksum, num_tensors=a.num_tensors)
        self._drop(self.table.admit(version, stage.owner))
        self.adapters[version] = held
        self.received = stage.tensors
        return self._served()

    def _rpc_track(self, requests):
        return self.table.track(requests)

    def _rpc_release(self, request_ids):
        freed = self.table.release(request_ids)
        self._drop(freed)
        return {"freed": freed}

    def _rpc_clear(self):
        self._drop(self.table.clear())                  # pin: refused while requests run on a held version
        return self._served()

    def _rpc_status(self):
        return {**self._served(), "staged": self.st.version, "stage_idle_s": self.st.idle_s(),
                "stage_timeout_s": self.st.timeout_s, "stages_expired": self.st.expired}

    def _served(self) -> dict:
        """The runtime's status: the newest held version, its checksum and size, and the version table."""
        v = self.table.newest
        a = self.adapters.get(v, {})
        return {"version": v, "checksum": a.get("checksum"), "num_tensors": a.get("num_tensors", 0),
                "mode": "unmerged", **self.table.status()}

    def _drop(self, versions) -> None:
        for v in versions:
            self.adapters.pop(v, None)

    def send_bucket(self, version, index, tensors):
        if index == self.fail_bucket:
            raise ValueError("bucket lost")
        if self.folder is None:
            self.st.bucket(version, index, {k: v.clone() for k, v in tensors.items()})
        else:
            from safetensors.torch import save_file

            save_file(dict(tensors), str(self.folder / f"v{version}-{index:05d}.safetensors"))
