"""The worker extension's entries for the base weights (vllm/base_sync.py: sent through vLLM's start/update/
finish_weight_update, our full-weight backend installed as the worker's weight-transfer engine), and for a peer's
base (an engine that starts empty gets the checkpoint bytes a live engine kept). MoELoRAWorkerExtension
(worker_ext.py) mixes them in; they share its staging timeout and its route capture."""
from __future__ import annotations

from .entry import entry


class BaseWeightEntries:
    @entry
    def moe_lora_base_init(self, keep: bool = False) -> dict:
        """Our full-weight backend as this worker's weight-transfer engine; the base comes before any adapter. keep:
        the version that serves next keeps its checkpoint bytes for a peer (moe_lora_base_export_begin)."""
        from .base_sync import BACKEND, install

        rt = getattr(self, "_moe_lora_rt", None)
        if rt is not None and rt.table.held:
            raise ValueError(f"adapter versions {rt.table.held} are served: the base is synced before any adapter")
        eng = install(self)
        self._moe_lora_base_expire(eng, refuse=True)
        eng.set_keep(keep)
        eng.on_served = self._moe_lora_base_served
        return {"backend": BACKEND, "served": eng.served}

    def _moe_lora_base_served(self) -> None:
        """A new base serves: every stored prompt route was computed under the old base (the base salt and the
        untracked one alike), so the route store keeps only the held adapter versions' (none: the base is synced
        before any adapter)."""
        from .versions import cache_salt

        cap = getattr(self, "_moe_lora_capture", None)
        if cap is not None:
            rt = getattr(self, "_moe_lora_rt", None)
            cap.new_weights({cache_salt(v) for v in (rt.table.held if rt is not None else ())})

    def _moe_lora_base_expire(self, eng, refuse: bool = False) -> bool:
        """An open base update (start_weight_update without finish or abort) idle for stage_timeout_s is aborted,
        with one line in the log (its sender died between start and finish); refuse: a younger one is refused
        (ValueError) rather than left to a second sender. True when one was aborted."""
        if not getattr(self, "_weight_update_active", False):
            return False
        timeout, idle = self._moe_lora_staging().timeout_s, eng.idle_s()
        if idle < timeout:
            if refuse:
                raise ValueError(f"a base update is open on this engine (version {eng.version}, idle {idle:.1f} s): "
                                 f"finish it, moe_lora_base_abort, or let it expire ({timeout:g} s without progress)")
            return False
        print(f"moe_lora: base update of version {eng.version} aborted: no bucket for {idle:.1f} s (stage_timeout_s "
              f"{timeout:g}); base version {eng.served} stays served", flush=True)
        self.moe_lora_base_abort()
        return True

    @entry
    def moe_lora_base_abort(self) -> dict:
        """Drop an open base update (what arrived of it is discarded; the weights were not touched)."""
        from .base_sync import install

        eng = install(self)
        eng.abort()
        if getattr(self, "_weight_update_active", False):
            eng.reset_weight_update_target()
            self._weight_update_active = False
        return {"served": eng.served}

    # -- a peer's base: an engine that starts empty gets the checkpoint bytes a live engine kept -----------------
    @entry
    def moe_lora_base_export_begin(self, bucket_bytes: int) -> dict:
        """Open an export of the base this engine keeps (synced with keep) for a peer: {version, buckets, bytes}.
        ValueError when it keeps none."""
        from .base_sync import engine_class

        eng = getattr(self, "weight_transfer_engine", None)
        if eng is None or type(eng) is not engine_class():
            raise ValueError("this engine keeps no copy of its base to give a peer (it was loaded from disk, "
                             "never synced, or synced without keep)")
        self.moe_lora_base_export_end()
        self._moe_lora_export = eng.export(int(bucket_bytes))
        return self._moe_lora_export.begin()

    @entry
    def moe_lora_base_export_bucket(self, index: int, inline: bool = False) -> dict:
        """Bucket `index` of the open export (written now), as the peer's update_weights takes it; inline: with its
        bytes (transport http, for a peer on another host)."""
        exp = getattr(self, "_moe_lora_export", None)
        if exp is None:
            raise ValueError("no base export is open on this engine (moe_lora_base_export_begin first)")
        return exp.bucket(int(index), bool(inline))

    @entry
    def moe_lora_base_export_end(self) -> dict:
        """Close the export (its shared-memory segments removed); idempotent."""
        exp, self._moe_lora_export = getattr(self, "_moe_lora_export", None), None
        if exp is not None:
            exp.close()
        return {"closed": exp is not None}

    @entry
    def moe_lora_base_status(self) -> dict:
        """served: the base version these weights are (None: never synced), and the receiver's timers."""
        from .base_sync import engine_class

        eng = getattr(self, "weight_transfer_engine", None)
        if eng is None or type(eng) is not engine_class():
            return {"served": None}
        return {"served": eng.served, **eng.timers}
