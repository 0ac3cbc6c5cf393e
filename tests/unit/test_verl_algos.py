"""verl's GRPO advantages, policy losses, aggregation and rollout correction through moe_lora_rl/algos.py,
checked against values computed by hand on small tensors (exact up to float32 rounding: tol 1e-6)."""
import math

import numpy as np

import pytest
import torch

pytest.importorskip("verl")

from moe_lora_rl.algos import (GlobalBatch, PolicyLossSettings, aggregate, grpo_advantages,  # noqa: E402
                                                 policy_loss, rollout_correction, rollout_rejection)

TOL = dict(rtol=0, atol=1e-6)


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = ["p0", "p0", "p0", "p0", "p1", "p2", "p2"]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
    adv = grpo_advantages(rewards, mask, groups)
    s0 = 0.5 / math.sqrt(4 * 0.25 / 3)          # group p0: mean 0.5, unbiased std sqrt(1/3)
    per_seq = torch.tensor([s0, -s0, -s0, s0, 1.0, 0.0, 0.0])   # p1 alone: mean 0, std 1; p2: equal rewards -> 0
    torch.testing.assert_close(adv, per_seq[:, None] * mask, rtol=0, atol=1e-5)   # eps=1e-6 in the denominator
    # Dr.GRPO: no division by the std
    adv2 = grpo_advantages(rewards, mask, groups, norm_by_std=False)
    torch.testing.assert_close(adv2[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, 0.0, 0.0]), **TOL)
    # negative control: grouping all seven together gives different advantages
    assert not torch.allclose(grpo_advantages(rewards, mask, ["p"] * 7), adv, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grpo_equal_rewards_give_exact_zeros(dtype):
    """A group of two or more equal rewards: advantages exactly 0 for any value (verl's fp32 mean of equal
    non-dyadic values differs from them by a rounding step, which the std's ~1e-7 + eps inflated: eight of 0.35 gave
    +0.0289). Groups of other rewards and a group of one: verl's own numbers (<= 1e-6), through our function and
    through the estimator registered in verl's registry (integration/verl/plugin.py)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_adv_estimator_fn

    values = [0.35, 0.1, 0.7, 1 / 3, 0.2, 1e-3, 12.345, -0.6, 0.0, 1.0]
    for n in (2, 3, 8):
        rewards = torch.tensor([v for v in values for _ in range(n)], dtype=dtype)
        groups = [f"g{i // n}" for i in range(len(rewards))]
        mask = torch.ones(len(rewards), 3)
        adv = grpo_advantages(rewards, mask, groups)
        assert adv.abs().max().item() == 0.0, (n, dtype, adv[:, 0].tolist())
        assert grpo_advantages(rewards, mask, groups, norm_by_std=False).abs().max().item() == 0.0
    # control: verl's own estimator on the same rewards gives the residue (the fault this fixes)
    r = torch.full((8,), 0.35)
    tok = torch.zeros(8, 3)
    tok[:, -1] = r
    verl_adv, _ = compute_grpo_outcome_advantage(tok, torch.ones(8, 3), np.array(["g"] * 8, dtype=object))
    assert verl_adv.abs().max().item() > 1e-3
    # mixed groups, a group of one and partial credit: as before
    rewards = torch.tensor([0.35, 0.35, 0.35, 0.1, 0.2, 0.9, 0.5, 0.4, 0.4], dtype=dtype)
    groups = ["a", "a", "a", "b", "b", "b", "c", "d", "d"]
    mask = torch.tensor([[1, 1, 0]] * 9)
    tok = torch.zeros(9, 3)
    tok[torch.arange(9), 1] = rewards.float()
    ref, _ = compute_grpo_outcome_advantage(tok, mask.float(), np.array(groups, dtype=object))
    adv = grpo_advantages(rewards, mask, groups)
    assert adv[[0, 1, 2, 7, 8]].abs().max().item() == 0.0
    torch.testing.assert_close(adv[3:7], ref[3:7], rtol=0, atol=1e-6)
    assert adv[6, 0].item() == pytest.approx(0.5, abs=1e-6)              # a group of one: mean 0, std 1 (verl's)
    from moe_lora_rl.algos import GRPO_EXACT
    from moe_lora_rl.integration.verl import plugin

    plugin.register()
    fn = get_adv_estimator_fn(GRPO_EXACT)                                # verl's route: algorithm.adv_estimator
    got, _ = fn(token_level_rewards=tok, response_mask=mask.float(), index=np.array(groups, dtype=object),
                config={"norm_adv_by_std_in_grpo": True})
    torch.testing.assert_close(got, adv, rtol=0, atol=0)


def test_grpo_advantages_bad_input():
    with pytest.raises(ValueError, match="group ids"):
        grpo_advantages(torch.ones(2), torch.ones(2, 3), ["a"])
    with pytest.raises(ValueError, match="no valid token"):
        grpo_advantages(torch.ones(2), torch.tensor([[1, 0], [0, 0]]), ["a", "a"])


def _vanilla_by_hand(ratio, adv, low=0.2, high=0.2, c=3.0):
    """PPO clip with dual clip, one token."""
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    return min(loss, -adv * c) if adv < 0 else loss


CASES = [(math.exp(0.5), 1.0), (0.5, 1.0), (0.5, -1.0), (5.0, -1.0), (1.1, 2.0), (0.9, -0.5)]


def _tensors():
    ratios = torch.tensor([r for r, _ in CASES]).reshape(2, 3)
    adv = torch.tensor([a for _, a in CASES]).reshape(2, 3)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -0.7]])
    return old, old + ratios.log(), adv


def test_vanilla_ppo_clip_by_hand():
    old, new, adv = _tensors()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, metrics = policy_loss(old, new, adv, mask, PolicyLossSettings())
    per_tok = [_vanilla_by_hand(r, a) for r, a in CASES]
    expect = sum(per_tok[:5]) / 5                                   # token-mean over the 5 valid tokens
    assert abs(loss.item() - expect) < 1e-6
    # (values: -1.2, -0.5, 0.8, 3.0 (dual clip), -2.2) -> mean -0.02)
    assert abs(expect - (-1.2 - 0.5 + 0.8 + 3.0 - 2.2) / 5) < 1e-9
    assert {"actor/pg_clipfrac", "actor/ppo_kl"} <= set(metrics)
    # asymmetric clip (DAPO clip-higher) changes only the ratio=1.6487, A=+1 token: -1.28 instead of -1.2
    loss_hi, _ = policy_loss(old, new, adv, mask, PolicyLossSettings(clip_ratio_high=0.28))
    assert abs(loss_hi.item() - (expect - 0.08 / 5)) < 1e-6
    # negative control: without clipping the loss is the plain -A * ratio mean, which differs
    plain = sum(-a * r for r, a in CASES[:5]) / 5
    assert abs(plain - expect) > 0.1


def test_policy_loss_with_tis_weights_and_global_tokens():
    old, new, adv = _tensors()
    mask = torch.ones(2, 3)
    w = torch.tensor([[1.0, 0.5, 2.0], [0.0, 1.0, 1.0]])
    per_tok = torch.tensor([_vanilla_by_hand(r, a) for r, a in CASES]).reshape(2, 3)
    loss, _ = policy_loss(old, new, adv, mask, PolicyLossSettings(), GlobalBatch(batch_num_tokens=12),
                          rollout_is_weights=w)
    assert abs(loss.item() - (per_tok * w).sum().item() / 12) < 1e-6


def test_gspo_sequence_ratio_by_hand():
    old, new, adv = _tensors()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])      # GSPO: one advantage per sequence
    mask = torch.ones(2, 3)
    loss, _ = policy_loss(old, new, adv, mask, PolicyLossSettings(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean"))
    expect = 0.0
    for i in range(2):
        s = math.exp(float((new[i] - old[i]).mean()))              # geometric-mean ratio of the sequence
        a = adv[i, 0].item()
        expect += max(-a * s, -a * min(max(s, 0.8), 1.2)) / 2
    assert abs(loss.item() - expect) < 1e-6
    vanilla, _ = policy_loss(old, new, adv, mask, PolicyLossSettings(loss_agg_mode="seq-mean-token-mean"))
    assert abs(vanilla.item() - expect) > 1e-3                       # negative control: token ratios differ


def test_aggregate_modes_and_microbatch_split():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert abs(aggregate(loss, mask, "token-mean").item() - 18 / 5) < 1e-6
    assert abs(aggregate(loss, mask, "token-sum").item() - 18) < 1e-6
    assert abs(aggregate(loss, mask, "seq-mean-token-mean").item() - (1.5 + 5.0) / 2) < 1e-6
    assert abs(aggregate(loss, mask, "seq-mean-token-sum").item() - (3 + 15) / 2) < 1e-6
    # two microbatches (or two DP ranks whose gradients are averaged) with the global token count sum to the whole
    parts = [aggregate(loss[i:i + 1], mask[i:i + 1], "token-mean", GlobalBatch(batch_num_tokens=5)) for i in range(2)]
    assert abs(sum(parts).item() - 18 / 5) < 1e-6
    dp = [aggregate(loss[i:i + 1], mask[i:i + 1], "token-mean", GlobalBatch(dp_size=2, batch_num_tokens=5))
          for i in range(2)]
    assert abs((sum(dp) / 2).item() - 18 / 5) < 1e-6
    # negative control: the per-microbatch token mean does not give the global mean (3 tokens vs 2 tokens)
    local = [aggregate(loss[i:i + 1], mask[i:i + 1], "token-mean") for i in range(2)]
    assert abs((sum(local) / 2).item() - 18 / 5) > 0.1
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(loss, mask, "mean")


def test_rollout_correction_truncated_is_by_hand():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -0.1, -3.0]])
    rollout = torch.tensor([[-1.5, -0.5, -3.0], [-2.0, -0.1, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, metrics = rollout_correction(old, rollout, mask, threshold=2.0)
    expect = torch.tensor([[math.exp(0.5), math.exp(-0.5), 2.0], [1.0, 1.0, 0.0]])   # exp(2) truncated to 2
    torch.testing.assert_close(w, expect, rtol=1e-6, atol=1e-6)
    assert not w.requires_grad and any(k.startswith("rollout_corr/") for k in metrics)
    ws, _ = rollout_correction(old, rollout, mask, level="sequence", threshold=10.0)
    seq0 = math.exp(0.5 - 0.5 + 2.0)                              # product of the row's ratios = e^2 < 10
    torch.testing.assert_close(ws[0], torch.full((3,), seq0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ws[1], torch.tensor([1.0, 1.0, 0.0]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="level"):
        rollout_correction(old, rollout, mask, level="tok")


def test_rollout_rejection_mis_by_hand():
    """MIS: tokens with ratio exp(old - rollout) outside [1/2, 2] leave the mask (and the token-mean normaliser),
    kept tokens are not reweighted, padding is never counted."""
    old, new, adv = _tensors()
    ln2, eps = math.log(2.0), 1e-3
    log_ratio = torch.tensor([[ln2 - eps, ln2 + eps, -ln2 + eps],        # 1.998 kept, 2.002 out, 0.5005 kept
                              [-ln2 - eps, 0.3, 5.0]])                   # 0.4995 out, 1.35 kept, padding (e^5)
    rollout = old - log_ratio
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    keep, metrics = rollout_rejection(old, rollout, mask, threshold=2.0)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [[True, False, True], [False, True, False]]
    # rejected share of the 5 valid tokens: 2/5 (3/6 if the padding's e^5 were counted)
    assert abs(metrics["rollout_corr/rollout_rs_masked_fraction"] - 2 / 5) < 1e-6
    # the loss over the kept tokens, unweighted (TIS would weigh token 0 by 1.998), normalised by the 3 kept tokens
    per_tok = [_vanilla_by_hand(r, a) for r, a in CASES]
    loss, _ = policy_loss(old, new, adv, keep, PolicyLossSettings(), GlobalBatch(batch_num_tokens=int(keep.sum())))
    assert abs(loss.item() - (per_tok[0] + per_tok[2] + per_tok[4]) / 3) < 1e-6
    full, _ = policy_loss(old, new, adv, mask, PolicyLossSettings())
    assert abs(full.item() - loss.item()) > 0.1                          # the rejection changed the loss
    # negative control: a wide band rejects nothing and gives the loss without rollout correction, exactly
    wide, metrics = rollout_rejection(old, rollout, mask, threshold=1e3)
    assert torch.equal(wide, mask) and metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    loss_wide, _ = policy_loss(old, new, adv, wide, PolicyLossSettings())
    assert torch.equal(loss_wide, full)
    with pytest.raises(ValueError, match="threshold=1.0"):
        rollout_rejection(old, rollout, mask, threshold=1.0)


def test_settings_validation():
    with pytest.raises(ValueError, match="loss_mode 'ppo'"):
        PolicyLossSettings(loss_mode="ppo")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossSettings(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm' needs loss_scale_factor"):
        PolicyLossSettings(loss_agg_mode="seq-mean-token-sum-norm")        # verl would divide by the padded width
    with pytest.raises(ValueError, match="loss_scale_factor=0"):
        PolicyLossSettings(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=0)
