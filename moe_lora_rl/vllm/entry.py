"""The first-call hook of the worker extension: vLLM 0.32 mixes the extension into its worker class and never calls
its __init__, so every moe_lora_* method is wrapped in `entry`, which checks the vLLM version (ValueError, nothing
changed) and applies our fixes to vLLM once per process (reload_fix) and to the loaded model once per worker
(rope_fix) before the method's body."""
from __future__ import annotations

import functools

from .compat import check_vllm_version

_FIXES_APPLIED = False


def _ensure_ready() -> None:
    """The version check and the fixes, once per process (every push calls several entries)."""
    global _FIXES_APPLIED
    if _FIXES_APPLIED:
        return
    check_vllm_version()
    from . import reload_fix

    reload_fix.apply()
    _FIXES_APPLIED = True


def ensure_model_ready(worker) -> dict:
    """The fixes that act on the loaded model's modules (rope_fix, gdn_torch), once per worker."""
    done = getattr(worker, "_moe_lora_model_fixes", None)
    if done is None:
        from . import gdn_torch, rope_fix

        model = worker.model_runner.model
        done = worker._moe_lora_model_fixes = {"mla_rope_routed": rope_fix.apply(model),
                                               "gdn_torch_layers": gdn_torch.apply(model)}
    return done


def entry(method):
    """An extension method callable through collective_rpc: version check and fixes before its body."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        _ensure_ready()
        ensure_model_ready(self)
        return method(self, *args, **kwargs)
    return wrapper
