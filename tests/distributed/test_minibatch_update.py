"""PPO mini-batches and epochs through rl/trainer_step.py's train_on (tests/kit/minibatch_worker.py): one torchrun
launch of 2 ranks (ep2, dp 2) on the tiny GLM4-MoE, fp32, R3 with random routes, lr 2e-2 so later mini-steps clip.

Tolerances: train_on with 1 mini-batch and 1 epoch takes its proximal logprobs from the update's own forward
(Policy.update with old_logprobs=None), which must equal the separate proximal pass followed by the update: adapters,
metrics, the proximal logprobs and the router disagreement are compared bit for bit (control: a proximal off by 0.01
per token gives other adapters); mini_batches=4 against 4 updates by hand on the same slices with the same old logprobs runs the same
products, but the slices' GEMMs have other shapes than the whole batch's, and on CPUs whose oneDNN kernels block by
shape (AVX-512/AMX) they round differently; four AdamW steps at lr 2e-2 carry that to the adapters: <= 1e-3 (measured
0.0 on an AVX2 machine, 9.6e-5 on an AMX one), a hundredth of the controls below. ministep0_rollout_kl with the rollout logprobs taken as the
replayed recompute: <= 1e-10 (measured 0.0: the update forward reproduces it); the control replays the routes
shuffled over tokens in the update: > 1e-3 (measured 193). Controls for the adapters: the mini-batches in reverse
order (measured 0.16) and the single update (0.10) differ by > 1e-3.
"""
import importlib.util

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                                                    reason="verl is not installed (the policy loss is verl's)")]


def _argv(workdir):
    from moe_lora_rl.models import get_model

    return ["--model", str(get_model("glm4_moe", "tiny"))]


# in one launch with the other 2-rank workers on the tiny models (tests/conftest.py)
LAUNCH = {"minibatch": {"nproc": 2, "module": "kit.minibatch_worker", "args": _argv}}


@pytest.fixture(scope="module")
def rep(shared_launch):
    return shared_launch("minibatch")[0]


def test_one_mini_batch_one_epoch_is_todays_update(rep):
    assert rep["single_bit_equal"] is True and rep["single_version"] == 1
    assert all(rep["single_metrics_equal"].values()), rep["single_metrics_equal"]
    # the fused proximal (the update's own forward) is the separate pass's, bit for bit; a proximal off by 0.01
    # per token gives other adapters (the comparison can fail)
    assert rep["fused_proximal_equal"] is True and rep["fused_disagreement_equal"] is True
    assert rep["single_control_equal"] is False
    m = rep["single_metrics"]
    assert m["grad_norm"] > 0 and "mini_steps" not in m                       # the single-step path
    assert m["ministep0_rollout_kl"] == m["ministep_last_rollout_kl"] == m["update_rollout_kl"]


def test_four_mini_batches_are_four_steps_against_the_proximal(rep):
    m = rep["mini4_metrics"]
    assert rep["mini4_version"] == rep["hand_version"] == 4 and rep["mini4_skipped"] is False
    assert (m["mini_steps"], m["mini_steps_skipped"]) == (4, 0)
    # the proximal logprobs: one pass over the whole batch vs the hand's slices (GEMM shapes again: 0.0 on AVX2,
    # 7.6e-6 on AMX; fp32 logprobs of one model agree to 1e-4, checks/tolerances.py)
    assert rep["mini4_vs_hand"] <= 1e-3 and rep["proximal_vs_hand_old"] <= 1e-4, rep
    clip = rep["hand_clipfrac"]
    assert clip[0] == 0.0 and min(clip[1:]) > 0, clip        # step 0: policy = proximal; later ones moved and clip
    assert m["pg_clipfrac_last"] == clip[-1] and abs(m["pg_clipfrac"] - sum(clip) / 4) <= 1e-12
    assert m["grad_norm_max"] >= m["grad_norm"] > 0
    assert rep["mini4_vs_reverse"] > 1e-3 and rep["mini4_vs_single"] > 1e-3, rep           # controls
    # the first mini-batch's proximal from its own update forward, the rest from one pass over the other rows: the
    # step is the separate whole-batch pass's (fuse=False), and the disagreement put together from the two passes
    # is one whole-batch pass's to rounding
    # (the same GEMM-shape rounding as above: <= 1e-3 on the adapters, 1e-4 on the metrics; AMX: 9.6e-5, 3.8e-5)
    assert rep["mini4_vs_separate"] <= 1e-3 and rep["mini4_metrics_vs_separate"] <= 1e-4, rep
    assert rep["mini4_disagreement_vs_full"] <= 1e-12 and rep["mini4_disagreement"] > 0, rep


def test_epochs_double_the_steps(rep):
    assert rep["epochs2_version"] == 8 and rep["epochs2_mini_steps"] == 8


def test_first_mini_step_reproduces_the_replayed_rollout(rep):
    ok, ctrl = rep["kl_replayed"], rep["kl_shuffled"]
    assert ok["ministep0_rollout_kl"] <= 1e-10, ok
    assert ok["ministep_last_rollout_kl"] > 1e-3, ok            # the last mini-step's policy has moved
    assert ctrl["ministep0_rollout_kl"] > 1e-3, ctrl            # wrong routes in the update: far off


def test_grouped_experts_update_as_sequential(rep):
    """runtime.experts=grouped: megatron's legacy GroupedMLP (grouped GEMMs) in place of SequentialMLP gives the
    same replayed logprobs and the same update to fp32 rounding (<= 1e-4: the per-expert GEMMs are the same products
    in other shapes, measured 0.0 on an AVX2 machine, 8.6e-6 and 2.0e-5 on an AMX one whose kernels block by shape);
    the control, the grouped model replaying the routes shuffled over tokens, is far off (> 1e-2)."""
    assert "GroupedMLP" in rep["grouped_class"] and "SequentialMLP" not in rep["grouped_class"], rep["grouped_class"]
    assert rep["grouped_logprobs_diff"] <= 1e-4 and rep["grouped_update_diff"] <= 1e-4, rep
    assert rep["grouped_shuffled_diff"] > 1e-2, rep
