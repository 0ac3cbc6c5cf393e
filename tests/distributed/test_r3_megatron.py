"""R3 in Megatron at tp2ep2 and pp2ep2, padded and packed: a bf16 rollout (HF transformers standing in for the
rollout engine here) records routes and logprobs; Megatron fp32 recomputes. Without replay the routers disagree
with the rollout on some decisions; with R3 on none, every route consumed exactly once, and the k3 KL to the
rollout's logprobs drops. GLM4-MoE covers the dense-first-layer offset (its routes start at layer 1) and, under
pp2, a stage whose MoE layers are global layers 2 and 3."""
import pytest

from moe_lora_rl.bench.common import resolve_models
from moe_lora_rl.bench.replay_check import run

pytestmark = pytest.mark.dist


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(_has_vllm(), reason="with vLLM installed, tests/e2e/test_r3_vllm.py runs the same check on real "
                                        "vLLM rollouts; this HF stand-in covers the megatron-core 0.19 venv")

def test_r3_zero_disagreement(tmp_path):
    res = run(resolve_models(None), "tp2ep2,pp2ep2", tmp_path)
    for layout in ("tp2ep2", "pp2ep2"):
        for m, per in res[layout].items():
            for kind in ("padded", "packed"):
                r = per[kind]
                assert r["decisions"] > 1000, (layout, m, kind, r)
                assert r["disagreement_without"] > 0, (layout, m, kind, r)
                assert r["disagreement_with"] == 0.0, (layout, m, kind, r)
                assert r["kl_with"] < r["kl_without"], (layout, m, kind, r)
