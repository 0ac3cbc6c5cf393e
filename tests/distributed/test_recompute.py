"""Activation recompute with R3 replay (megatron/transformer_options.py, router_replay/replayer.py's recompute queue,
build.frozen_base_recompute), tests/kit/recompute_worker.py on the tiny GLM4-MoE: in CI one torchrun launch of 2 ranks
at tp2ep2 (sequence parallel, experts split); marked slow, 4 ranks at tp1ep1pp1 (dp4) and pp2ep2 (two stages, 1F1B
over 4 microbatches). Random R3 routes (the router would choose otherwise in ~3/4 of the decisions).

Against no recompute, for full/uniform/1 (verl's Megatron LoRA example), full/block/2 (layers 0-1 recomputed, 2-3
not) and selective (core_attn, layernorm, mlp, moe, shared_experts):
- logprobs of the eval forward and of the training forward: max |diff| <= 1e-6 (measured 0);
- every adapter factor's gradient (224): max |diff| <= 1e-6 (measured <= 4e-7; the recompute's reductions run in
  another order), none zero;
- every route consumed exactly once per forward (per layer, 8 rows x TP ranks summed over ranks) and once more by
  the recompute in each recomputed MoE layer (none in the layers block/2 leaves alone, none in the eval pass).
Negative controls on full/uniform/1: the recompute routing freely (recompute queue off) gives gradients off by
> 1e-2 of their scale; without the frozen-base hook the checkpointed layers' routes are never recomputed (the base
gives the chunks no input that requires grad), so no adapter gets a gradient and nothing else says so: the pass
fails on the unconsumed recompute routes.
"""
import importlib.util

import pytest

from moe_lora_rl.checks.torchrun import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                                                    reason="verl is not installed (the policy loss is verl's)")]

VARIANTS = ("full_uniform_1", "full_block_2", "selective")
MOE_LAYERS = ("1", "2", "3")
RUNS = {"ci": (2, ("tp2ep2",)), "slow": (4, ("tp1ep1pp1", "pp2ep2"))}


# CI's run in one launch with the other 2-rank workers on the tiny models (tests/conftest.py)
LAUNCH = {"recompute": {"nproc": RUNS["ci"][0], "module": "kit.recompute_worker", "param": "ci",
                        "args": lambda workdir: ["--layouts", ",".join(RUNS["ci"][1])]}}


@pytest.fixture(scope="module", params=[pytest.param("ci"), pytest.param("slow", marks=pytest.mark.slow)])
def rep(request, shared_launch):
    nproc, layouts = RUNS[request.param]
    if request.param == "ci":
        got, _ = shared_launch("recompute")
    else:
        got = run_torchrun("kit.recompute_worker", nproc, ["--layouts", ",".join(layouts)])
    assert tuple(got) == layouts
    return got


def _variants(rep):
    for key in rep:
        for name in VARIANTS:
            yield key, name, rep[key][name]


def test_logprobs_and_gradients_equal_no_recompute(rep):
    for key, name, r in _variants(rep):
        assert r["logprob_max_diff"] <= 1e-6 and r["train_logprob_max_diff"] <= 1e-6, (key, name, r)
        assert r["grad_max_diff"] <= 1e-6, (key, name, r["grad_max_diff"])
        assert r["n_factors"] == 224 and r["zero_grad_factors"] == 0, (key, name, r)
        assert r["loss"] == pytest.approx(rep[key]["none"]["loss"], rel=1e-6, abs=1e-7), (key, name)


def _routed(key):
    """Routes replayed per layer in one pass, summed over ranks: one per row (8) and TP rank (each routes its
    sequence-parallel slice)."""
    return 8 * (2 if key.startswith("tp2") else 1)


def test_every_route_consumed_once_and_once_more_by_the_recompute(rep):
    for key in rep:
        assert rep[key]["none"]["consumed"] == {l: [_routed(key), 0] for l in MOE_LAYERS}, key
    for key, name, r in _variants(rep):
        # block/2 recomputes the first 2 layers of each stage: layer 1 at pp1; every layer at pp2 (2 per stage)
        recomputed = ("1",) if name == "full_block_2" and "pp2" not in key else MOE_LAYERS
        n = _routed(key)
        want = {l: [n, n if l in recomputed else 0] for l in MOE_LAYERS}
        assert r["consumed"] == want, (key, name, r["consumed"])
        assert r["eval_consumed"] == {l: [n, 0] for l in MOE_LAYERS}, (key, name, r["eval_consumed"])


def test_free_recompute_differs(rep):
    for key in rep:
        c = rep[key]["ctrl_free_recompute"]
        assert c["train_logprob_max_diff"] <= 1e-6, (key, c)          # the forward still replays
        assert c["grad_max_diff"] > 1e-2 * c["grad_scale"], (key, c["grad_max_diff"], c["grad_scale"])


def test_without_the_frozen_base_hook_the_recompute_never_runs(rep):
    for key in (k for k in rep if "pp2" not in k):             # pp1 only (the worker's control)
        c = rep[key]["ctrl_no_hook"]
        assert "routes left unconsumed" in c.get("error", ""), (key, c)
        assert c["zero_grad_factors"] == c["n_factors"] == 224, (key, c)     # silently no gradient at all
