"""The RL Policy (rl/policy.py) gives the same logprobs and the same update at every layout: one torchrun launch of
4 ranks runs tp1ep1pp1 (dp4), tp2ep2 (dp2, sequence parallel, the odd sequence padded to split) and pp2ep2 (dp2,
two stages) on the tiny GLM4-MoE (dense first layer, MoE layers 1-3) with per-expert LoRA on every target.

The batch: 8 rows of mixed lengths (6..23 tokens, right-padded), R3 routes of random experts, old logprobs away from
the current ones (about a third of the tokens clipped), rollout logprobs for token-level TIS, a KL term to the
adapters-off reference, adapters perturbed deterministically so A and B both get gradients, one row per microbatch
(2 microbatches per rank at dp4, 4 at dp2; and the same update again with two rows per microbatch), grad_clip
below the norm (clipping applied).

Tolerances (fp32; the only differences are reduction orders across TP/EP/PP splits and microbatch groupings):
- gathered adapter gradients after the step: max |diff| <= 1e-5 x max |gradient| (measured ~4e-6);
- grad norm and loss: relative 1e-5 (measured ~4e-8); clipping decision equal;
- logprobs: max |diff| <= 1e-5 x max |logprob| (measured 2.1e-5 absolute on logprobs up to ~35: 6e-7).
Negative control: the same update replaying the routes shuffled over tokens (through the R2 path, update(replay='r2',
routes=...)) differs by > 10% of the gradient scale (measured 164%).
R3 with the model's own recorded routes: disagreement exactly 0 and the logprobs of replay "off" (<= 5e-5, padding
positions route differently and fp32 GEMMs over different token sets differ in the last bits); random routes:
disagreement > 0.5 (expected 1 - 4/16 = 0.75); the fraction of tokens with a differing decision in any layer is 0 for
the own routes and, for the random ones, the same at every layout.
"""
import importlib.util

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                                                    reason="verl is not installed (the policy loss is verl's)")]

LAYOUTS = ("tp1ep1pp1", "tp2ep2", "pp2ep2")


# in one launch with the other 4-rank workers on the tiny models (tests/conftest.py)
LAUNCH = {"policy_update": {"nproc": 4, "module": "kit.policy_update_worker",
                            "args": lambda workdir: ["--layouts", ",".join(LAYOUTS)]}}


@pytest.fixture(scope="module")
def rep(shared_launch):
    return shared_launch("policy_update")[0]


def _each(rep):
    assert tuple(rep["layouts"]) == LAYOUTS
    return rep["per_layout"].items()


def test_update_is_layout_independent(rep):
    ref = rep["per_layout"][LAYOUTS[0]]["stats"]
    assert ref["clipped"] and ref["grad_norm"] > 0.5 and 0.05 < ref["pg_clipfrac"] < 0.95 and ref["kl"] > 0, ref
    for key, r in _each(rep):
        assert r["n_factors"] == 224 and r["zero_grad_factors"] == [] and r["nonzero_grad_A_and_B"] == [True, True]
        assert r["grad_rel_diff"] <= 1e-5, (key, r["grad_rel_diff"])
        assert r["mbs2_grad_rel_diff"] <= 1e-5, (key, r["mbs2_grad_rel_diff"])       # another microbatch split
        assert r["grad_norm_rel_diff"] <= 1e-5, (key, r["stats"], ref)
        assert r["loss_diff"] <= 1e-5 * max(1.0, abs(ref["loss"])), (key, r["stats"], ref)
        assert r["stats"]["clipped"] == ref["clipped"], key
        assert abs(r["stats"]["kl"] - ref["kl"]) <= 1e-5 * ref["kl"], (key, r["stats"], ref)
        assert abs(r["stats"]["pg_clipfrac"] - ref["pg_clipfrac"]) <= 1e-6, key
        assert r["stats_same_on_every_rank"] and r["version"] == 1 and r["step_moved"] > 0, key


def test_grad_norm_counts_each_shard_once(rep):
    """After clipping the norm is grad_clip (0.5); summing every rank's local grads instead counts replicated
    factors again (measured 2x at tp1ep1pp1 (dp4), 1.6x at tp2ep2, 1.4x at pp2ep2) -- the control for double
    counting."""
    for key, r in _each(rep):
        assert abs(r["norm_after_clip"] - 0.5) <= 1e-5, (key, r["norm_after_clip"])
        assert r["naive_norm_after_clip"] > 1.2 * r["norm_after_clip"], (key, r["naive_norm_after_clip"])
    assert abs(rep["per_layout"]["tp1ep1pp1"]["naive_norm_after_clip"] - 1.0) <= 1e-5


def test_nan_on_one_rank_skips_the_step_on_every_rank(rep):
    """A NaN gradient on rank 0 only: the all-reduced norm is non-finite everywhere, so every rank skips alike
    (policy/optimizer_step.py). Control: the finite update before it stepped (version 1, step_moved > 0)."""
    want = {"skipped": True, "norm_non_finite": True, "unchanged": True, "version_kept": True, "grads_none": True}
    for key, r in _each(rep):
        assert r["nan_on_rank0"] == want, (key, r["nan_on_rank0"])
        assert r["version"] == 1 and r["step_moved"] > 0, key


def test_negative_control_shuffled_routes(rep):
    for key, r in _each(rep):
        assert r["ctrl_grad_rel_diff"] > 0.1, (key, r["ctrl_grad_rel_diff"])


def test_logprobs_are_layout_independent(rep):
    for key, r in _each(rep):
        assert r["logprobs_same_on_every_rank"], key
        for kind, d in r["logprob_rel_diff"].items():
            assert d <= 1e-5, (key, kind, r["logprob_max_diff"])
        assert r["ref_vs_r3"] > 0.1, key                      # adapters off changes the policy
        assert r["recorded_mismatch"][0] == 0 and r["recorded_mismatch"][1] > 0, (key, r["recorded_mismatch"])


def test_replay_of_own_routes_and_of_random_routes(rep):
    for key, r in _each(rep):
        assert set(r["own_disagreement"]) == {"1", "2", "3"}, key
        assert set(r["own_disagreement"].values()) == {0.0}, (key, r["own_disagreement"])
        assert r["own_vs_off"] <= 5e-5 and r["off_vs_record"] == 0.0, key
        assert min(r["random_disagreement"].values()) > 0.5, (key, r["random_disagreement"])
        assert r["random_vs_off"] > 0.1, key
        # tokens with a differing decision in >= 1 MoE layer: counted once whatever the layout (pp2: layers on two
        # stages; tp2 with sequence parallelism: each rank its slice of positions); at least any layer's fraction
        assert r["own_token_disagreement"] == 0.0, key
        assert max(r["random_disagreement"].values()) <= r["random_token_disagreement"] <= 1.0, key
        assert r["random_token_disagreement_vs_ref"] == 0.0, (key, r["random_token_disagreement"])


def test_push_sends_the_adapters(rep):
    p = rep["per_layout"][LAYOUTS[-1]]["push"]
    assert p["exact"] and p["tensors"] >= 224 and p["version"] == 1 and p["served"]["version"] == 1, p


def test_bad_inputs_name_the_value(rep):
    e = rep["per_layout"][LAYOUTS[0]]["errors"]
    expect = {
        "replay_mode": "replay='r2' is not one of ('r3', 'record', 'off')",
        "update_replay_mode": "replay='record' is not one of ('r3', 'r2', 'off') for update",
        "r2_without_routes": "replay='r2' needs routes=",
        "routes_tokens": "sample 0: routes cover 21 tokens; a sample of 23 tokens needs 22",
        "routes_samples": "routes for 7 samples, batch has 8",
        "routes_topk": "routes are for 16 experts top-2; the model has 16 experts top-4",
        "routes_layers": "routes have no MoE layers [1]",
        "routes_missing": "replay='r3' needs routes",
        "dp_split": "global batch of 6 rows does not split over data parallel size 4",
        "old_shape": "old_logprobs has shape (8, 21), expected (8, 22)",
        "microbatch_split": "2 rows per data-parallel rank (batch 8 / dp 4) do not split into microbatches of "
                            "micro_batch_size=3",
    }
    for name, text in expect.items():
        assert text in e[name], (name, e[name])
