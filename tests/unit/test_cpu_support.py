import pytest
import torch

from moe_lora_rl.megatron import cpu_support


_IMPORT_CHECK = r"""
import importlib, pkgutil, sys
import torch, torch.cuda
import megatron.core.tensor_parallel.mappings, megatron.core.tensor_parallel.random
import megatron.core.transformer.moe.moe_utils, megatron.core.transformer.moe.token_dispatcher
import megatron.core.transformer.moe.router, megatron.core.transformer.moe.moe_layer
targets = [torch.cuda, megatron.core.tensor_parallel.mappings, megatron.core.tensor_parallel.random,
           megatron.core.tensor_parallel.random.CudaRNGStatesTracker, megatron.core.transformer.moe.moe_utils,
           megatron.core.transformer.moe.token_dispatcher, megatron.core.transformer.moe.router.TopKRouter,
           megatron.core.transformer.moe.moe_layer.MoELayer]
try:
    import megatron.core.transformer.moe.grouped_gemm_util as g
    targets.append(g)
except ImportError:
    pass
before = [dict(vars(t)) for t in targets]
import moe_lora_rl
names = []
for pkg in ("megatron", "router_replay", "lora", "models", "refit", "policy", "checkpoint", "rollout", "checks",
            "bench"):
    mod = importlib.import_module(f"moe_lora_rl.{pkg}")
    for info in pkgutil.walk_packages(mod.__path__, f"moe_lora_rl.{pkg}."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
changed = [f"{getattr(t, '__name__', t)}.{k}" for t, b in zip(targets, before) for k in set(b) | set(vars(t))
           if b.get(k, None) is not vars(t).get(k, None)]
print("IMPORTED", len(names))
print("CHANGED", changed)
"""


def test_nothing_applied_at_import():
    """Importing every module of the package (in a fresh interpreter) replaces no attribute of torch.cuda or of the
    megatron-core modules and classes cpu_support or the replay hooks touch."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(l.split(" ", 1) for l in proc.stdout.splitlines() if l.startswith(("IMPORTED", "CHANGED")))
    assert int(out["IMPORTED"]) > 20, out
    assert out["CHANGED"] == "[]", out


def test_apply_is_explicit_idempotent_and_restorable():
    before = torch.cuda.current_device
    h = cpu_support.apply()
    assert cpu_support.apply() is h
    assert torch.cuda.current_device() == "cpu"
    from megatron.core.tensor_parallel import mappings
    assert mappings._gather_along_first_dim is cpu_support._gather_along_first_dim
    h.restore()
    assert torch.cuda.current_device is before
    assert mappings._gather_along_first_dim is not cpu_support._gather_along_first_dim


def test_untested_version_refused(monkeypatch):
    monkeypatch.setattr(cpu_support, "mcore_version", lambda: "0.12.0")
    monkeypatch.setattr(cpu_support, "_ACTIVE", None)
    with pytest.raises(RuntimeError, match="megatron-core 0.12.0 is untested"):
        cpu_support.apply()


def test_device_mode_rewrites_cuda_kwargs():
    h = cpu_support.apply()
    try:
        with h.cuda_device_kwargs_to_cpu():
            t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu"
    finally:
        h.restore()
