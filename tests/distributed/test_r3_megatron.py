"""R3 in Megatron against the forced-route reference, with HF transformers (bf16) standing in for the rollout engine:
the megatron-core 0.19 venv has no vLLM. The same checks as tests/e2e/test_r3_vllm.py, which runs them on real vLLM
rollouts in the main venv (so this module is skipped there): every layout in one torchrun launch, padded and packed,
both tiny models; fidelity within 1e-4 of HF forced to the same routes (rollout and random sets), the shuffled-routes
control above 1e-2, the token dispatcher's routing map equal to the rollout-format routes, KL lower with R3. GLM4-MoE
covers the dense-first-layer offset (its routes start at layer 1) and, under pp2, a stage whose MoE layers are global
layers 2 and 3."""
import importlib.util

import pytest
import torch

from moe_lora_rl.checks.layouts import DEFAULT_LAYOUTS, resolve_models
from moe_lora_rl.checks.r3_run import run
from moe_lora_rl.checks.tolerances import FIDELITY_TOL, SHUFFLED_MIN

pytestmark = [pytest.mark.dist, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="vLLM is installed: tests/e2e/test_r3_vllm.py runs these checks on real vLLM rollouts")]


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run(resolve_models(None), DEFAULT_LAYOUTS, tmp_path_factory.mktemp("r3"), engine="hf", single_launch=True)


def _each(res):
    for layout in DEFAULT_LAYOUTS.split(","):
        for m, per in res[layout].items():
            for kind in ("padded", "packed"):
                yield (layout, m, kind), per[kind]


def test_replay_matches_forced_route_reference(res):
    for where, r in _each(res):
        assert max(r["fidelity_max_diff"].values()) <= FIDELITY_TOL[torch.float32], (where, r["fidelity_max_diff"])


def test_shuffled_routes_differ_and_forced_routes_are_not_the_routers_own(res):
    for m, sets in res["forced_decisions"].items():
        bad, tot = sum(b for b, _ in sets.values()), sum(t for _, t in sets.values())
        assert tot > 1000 and bad / tot >= 0.05, (m, sets)
    for where, r in _each(res):
        assert r["shuffled_routes_diff"] > SHUFFLED_MIN, (where, r)


def test_dispatcher_receives_the_rollout_routes(res):
    for where, r in _each(res):
        assert all(n > 0 for n in r["dispatcher_tokens"].values()), (where, r)
        assert set(r["dispatcher_mismatched_tokens"].values()) == {0}, (where, r["dispatcher_mismatched_tokens"])


def test_kl_drops_with_replay(res):
    for where, r in _each(res):
        assert r["disagreement_without"] > 0 and r["kl_with"] < r["kl_without"], (where, r)
