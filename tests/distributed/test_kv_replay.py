"""KV replay in the trainer: with each row's eviction record (the tokens an evicting sampler held for each query, per
layer and KV head), the Policy's logprobs equal HF transformers given the same masks, at tp1 (dp2), tp2 (the heads
split: each rank masks its own query heads by their KV head) and pp2 (layers on two stages: masks by global layer
index). Tiny GLM4-MoE, fp32, 4 rows of 27-48 tokens with 2-4 compressions each (tests/kit/kv_replay_worker.py).

Tolerance: Megatron vs HF in fp32, PARITY_FP32 on logprobs (reduction-order noise). Controls: the same Policy
without the records (dense attention) and HF with one kept position of one compression swapped for an evicted one
differ by > 1e-2.
"""
import pytest

from moe_lora_rl.checks.tolerances import PARITY_FP32

pytestmark = [pytest.mark.dist]

LAYOUTS = ("tp1ep1pp1", "tp2", "pp2")


def _argv(workdir):
    from moe_lora_rl.models import get_model

    return ["--model", str(get_model("glm4_moe", "tiny")), "--layouts", ",".join(LAYOUTS)]


# in one launch with the other 2-rank workers on the tiny models (tests/conftest.py)
LAUNCH = {"kv_replay": {"nproc": 2, "module": "kit.kv_replay_worker", "args": _argv}}


def test_trainer_replaying_the_eviction_matches_hf_with_the_held_tokens_at_every_layout(shared_launch):
    rep, _ = shared_launch("kv_replay")
    assert sorted(rep["layouts"]) == sorted(LAYOUTS)
    assert min(rep["events_per_row"]) >= 2, rep
    for key, d in rep["layouts"].items():
        assert d["same"] <= PARITY_FP32, (key, d)
        assert d["dense"] > 1e-2 and d["swapped"] > 1e-2, (key, d)
