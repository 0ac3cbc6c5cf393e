"""tests/kit/fakes.py's FakeEngine answers as the engine's worker extension does: the same method names and parameters
(read from vllm/worker_ext.py with `ast`, nothing of vLLM imported), and the same pin/switch rules for pushes and
the requests that run on a version."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import moe_lora_rl
from kit.fakes import FakeEngine

TENSORS = {"a": torch.zeros(4), "b": torch.ones(4)}


def _worker_entries() -> dict[str, list[str]]:
    """moe_lora_* methods of the worker extension -> their parameter names (self left out)."""
    src = (Path(moe_lora_rl.__file__).parent / "vllm" / "worker_ext.py").read_text()
    return {f.name: [a.arg for a in f.args.args[1:]] for f in ast.walk(ast.parse(src))
            if isinstance(f, ast.FunctionDef) and f.name.startswith("moe_lora_")}


def test_every_method_of_the_fake_is_the_engines_with_its_parameters():
    real = _worker_entries()
    fake = {"moe_lora_" + n.removeprefix("_rpc_"): list(inspect.signature(getattr(FakeEngine, n)).parameters)[1:]
            for n in dir(FakeEngine) if n.startswith("_rpc_")}
    assert {"moe_lora_track", "moe_lora_release", "moe_lora_status", "moe_lora_commit"} <= set(fake)
    for name, params in fake.items():
        assert name in real, f"FakeEngine serves {name}, which the engine does not have"
        assert params == real[name], (name, params, real[name])
    with pytest.raises(AssertionError, match="no method 'moe_lora_capture_pop'"):
        FakeEngine().call("moe_lora_capture_pop", ["r"])


def test_pin_requests_keep_their_version_and_free_it_when_they_end():
    eng = FakeEngine(inflight="pin", max_versions=2)
    assert eng.track([["base", None]]) == [None]                         # nothing pushed: the base model
    eng.push(1, TENSORS, 4, 8.0)
    assert eng.track([["r1", None]]) == [1]
    assert eng.push(2, TENSORS, 4, 8.0).served["versions"] == [1, 2]      # 1 stays: r1 runs on it
    assert eng.track([["r2", 1], ["r3", None]]) == [1, 2]
    st = eng.status()
    assert st["requests_per_version"] == {"None": 1, "1": 2, "2": 1} and not st["can_commit"], st
    with pytest.raises(ValueError, match="cannot commit adapter version 3: max_versions=2"):
        eng.push(3, TENSORS, 4, 8.0)
    assert eng.st.version is None and eng.table.held == [1, 2]            # the stage closed, nothing else moved
    with pytest.raises(ValueError, match="pinned to version 7"):
        eng.track([["r4", 1], ["r5", 7]])                                 # all or nothing: r4 is not tracked
    assert eng.release(["r1", "unknown"]) == {"freed": []}                # r2 still on 1
    assert eng.release(["r2"]) == {"freed": [1]} and sorted(eng.adapters) == [2]
    with pytest.raises(ValueError, match="versions \\[2\\] are in use"):
        eng.call("moe_lora_clear")
    assert eng.push(3, TENSORS, 4, 8.0).served["versions"] == [2, 3]
    assert eng.release(["r3", "base"]) == {"freed": [2]} and eng.status()["version"] == 3


def test_switch_serves_only_the_newest_and_refuses_a_stale_push():
    eng = FakeEngine()
    eng.push(1, TENSORS, 4, 8.0)
    assert eng.track([["r1", 1], ["r2", None]]) == [1, 1]
    with pytest.raises(ValueError, match="already tracked"):
        eng.track([["r1", None]])
    served = eng.push(2, TENSORS, 4, 8.0).served                          # switch: running requests move to 2
    assert served["versions"] == [2] and served["requests_per_version"] == {"2": 2}, served
    with pytest.raises(ValueError, match="inflight='switch' serves only the newest"):
        eng.track([["r3", 1]])
    with pytest.raises(ValueError, match="stale adapter version 2"):
        eng.push(2, TENSORS, 4, 8.0)
    assert eng.release(["r1", "r2"]) == {"freed": []}
    assert eng.call("moe_lora_clear")["version"] is None


def test_a_bad_policy_is_refused_as_the_engine_refuses_it():
    with pytest.raises(ValueError, match="moe_lora_max_versions=2: inflight='switch' holds exactly one"):
        FakeEngine(max_versions=2)
