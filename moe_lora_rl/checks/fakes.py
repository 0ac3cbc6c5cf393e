"""One engine without vLLM for checks of the push protocol: the /collective_rpc methods of our worker extension
(moe_lora_begin / bucket / commit / abort) served by the plugin's own staged-push state machine
(vllm/staging.py), and the commit validated by the engine's own adapter check (vllm/adapter_set.py, checksum
included) when the model's arch is given.

    FakeEngine()                   in memory: the transport and the engine in one process (rank 0 collects)
    FakeEngine(arch, folder=DIR)   every rank's sender reaches the same engine: buckets land as safetensors files
                                   in DIR, the committing rank reads them all
"""
from __future__ import annotations

from pathlib import Path

from ..refit.transports import _Base
from ..vllm.staging import Staging


class FakeEngine(_Base):
    def __init__(self, arch=None, folder: Path | None = None, bucket_bytes: int | None = None,
                 fail_bucket: int | None = None):
        """fail_bucket: sending that bucket index raises ValueError("bucket lost") (set it to None to heal)."""
        self.arch, self.folder, self.fail_bucket, self.st, self.received = arch, folder, fail_bucket, Staging(), {}
        if bucket_bytes is not None:
            self.bucket_bytes = bucket_bytes

    def _call(self, method, *args):
        if method == "moe_lora_begin":
            return self.st.begin(*args)
        if method == "moe_lora_abort":
            return self.st.abort(*args)
        if method != "moe_lora_commit":
            raise AssertionError(f"FakeEngine: no method {method!r}")
        if self.folder is not None:
            from safetensors.torch import load_file

            for f in sorted(self.folder.glob(f"v{args[0]}-*.safetensors")):
                self.st.bucket(args[0], int(f.stem.split("-")[1]), load_file(str(f)))
        stage = self.st.commit(*args)
        self.received = stage.tensors
        if self.arch is None:
            return {"version": stage.version}
        from ..vllm.adapter_set import build_adapter_set

        a = build_adapter_set(stage.tensors, self.arch, rank=stage.rank, alpha=stage.alpha, version=stage.version,
                              expected_checksum=stage.checksum)
        return {"version": a.version, "checksum": a.checksum, "num_tensors": a.num_tensors}

    def _send_bucket(self, version, index, tensors):
        if index == self.fail_bucket:
            raise ValueError("bucket lost")
        if self.folder is None:
            self.st.bucket(version, index, {k: v.clone() for k, v in tensors.items()})
        else:
            from safetensors.torch import save_file

            save_file(dict(tensors), str(self.folder / f"v{version}-{index:05d}.safetensors"))
