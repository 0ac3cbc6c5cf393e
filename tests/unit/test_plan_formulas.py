"""Every planner formula against a case computed by hand (the arithmetic is in the comments)."""
import math

import pytest

from moe_lora_rl.plan import formulas as F


def test_active_params():
    # 2 MoE layers x (4 - 1) idle experts x 3*10*3 weights = 540 idle of 1000
    assert F.active_params(1000, 2, 4, 1, 10, 3) == 460
    assert F.active_params(1000, 2, 4, 4, 10, 3) == 1000          # every expert active: all params


def test_kv_bytes_per_token():
    assert F.kv_bytes_per_token_gqa(48, 4, 128, 2) == 2 * 48 * 4 * 128 * 2 == 98304     # Qwen3-30B-A3B bf16
    assert F.kv_bytes_per_token_mla(61, 512, 64, 2) == 61 * 576 * 2 == 70272            # Kimi-K2 bf16


def test_expected_active_experts():
    assert F.expected_active_experts(4, 1, 1) == pytest.approx(1.0)            # one token, top-1
    assert F.expected_active_experts(4, 1, 2) == pytest.approx(4 * (1 - 0.75 ** 2))   # 1.75
    assert F.expected_active_experts(384, 8, 10_000) == pytest.approx(384)     # large batch touches all


def test_frozen_and_trainable_bytes():
    assert F.frozen_weight_bytes(1e9, 2, 8) == 2.5e8
    # 100 params over 2 shards: 50 * (2 + 4) + 50 * 12 = 900; optimizer over 4 DP replicas: 300 + 150
    assert F.trainable_state_bytes(100, 2) == 900
    assert F.trainable_state_bytes(100, 2, optimizer_shards=4) == 450
    assert F.trainable_state_bytes(100, 1, 0, 0, 12, 1) == 1200


def test_activation_bytes():
    # 2 in flight x 3 layers x s4 b2 h10 x 2 bytes / tp2 = 480
    assert F.checkpointed_activation_bytes(4, 2, 10, 3, 2, 2) == 480
    # s4 b1: attention 15h = 150, MoE 2h + k(2h + 4F + 2F) = 20 + 2 * (20 + 12 + 6) = 96 -> 4 * 246 = 984
    assert F.layer_working_bytes(4, 1, 10, 1, 2, 3) == 984
    assert F.layer_working_bytes(4, 1, 10, 2, 2, 3) == 492
    assert F.logits_bytes(4, 2, 100, 2) == 4 * 2 * 100 * 4 / 2 == 1600


def test_kv_concurrency():
    assert F.kv_concurrency(1000, 10, 30) == 3          # 1000 // 300
    assert F.kv_concurrency(299, 10, 30) == 0
    assert F.kv_concurrency(-5, 10, 30) == 0


def test_flops():
    assert F.attention_flops_per_token(2, 10, 4, 6) == 2 * 2 * 10 * (4 + 6) == 400
    # no recompute: fwd 2*100 + 2*1 + 10 = 212; bwd 2*100 + 4*1 + 2*10 = 224 -> 436
    assert F.lora_train_flops_per_token(100, 1, 10, False) == 436
    assert F.lora_train_flops_per_token(100, 1, 10, True) == 212 * 2 + 224
    # frozen base without adapters or attention: 4N = 2/3 of full training's 6N
    assert F.lora_train_flops_per_token(100, 0, 0, False) == pytest.approx(2 / 3 * 6 * 100)


def test_bubble_and_train_time():
    assert F.pipeline_bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert F.pipeline_bubble_fraction(1, 7) == 0
    # 1000 tokens * 1e6 FLOPs / (2 GPUs * 1e9 * 0.5 * (1 - 0.2)) = 1e9 / 8e8
    assert F.train_seconds(1000, 1e6, 2, 1e9, 0.5, 0.2) == pytest.approx(1.25)


def test_decode_and_rates():
    assert F.decode_step_seconds(1e9, 1e12, 1e12, 1e15) == pytest.approx(1e-3)      # 1 ms memory, 1 ms compute
    assert F.decode_step_seconds(2e9, 1e12, 1e12, 1e15) == pytest.approx(2e-3)      # memory bound
    assert F.decode_step_seconds(1e9, 3e12, 1e12, 1e15) == pytest.approx(3e-3)      # compute bound
    # 100 samples on 2 engines x 32 slots: 2 waves x 10 steps x 10 ms
    assert F.rollout_batch_seconds(100, 2, 32, 10, 0.01) == pytest.approx(0.2)
    assert F.rollout_batch_seconds(64, 2, 32, 10, 0.01) == pytest.approx(0.1)
    assert F.production_rate(2, 32, 10, 0.01) == pytest.approx(640)                 # 64 slots / 0.1 s
    assert F.consumption_rate(512, 256) == 2
    assert F.sync_step_seconds(1, 2, 3) == 6


def test_staleness():
    assert F.max_staleness(10, 5) == 2
    assert F.max_staleness(10, 4) == 3
    assert F.max_staleness(10, 10) == 1
    assert F.max_staleness(3, 10) == 1
    # terms: consumption 5, production 3 + 1 = 4, staleness 12 / 2 = 6
    assert F.async_step_seconds(5, 3, 1, 12, 2) == (6, "staleness")
    assert F.async_step_seconds(5, 3, 1, 12, 4) == (5, "consumption (training)")
    assert F.async_step_seconds(1, 3, 1, 12, 4) == (4, "production (rollout)")
    # the async step always satisfies the bound it was built from
    for gen, train, prod, s in [(12, 5, 3, 2), (100, 1, 1, 3), (7, 7, 7, 1)]:
        step, _ = F.async_step_seconds(train, prod, 0, gen, s)
        assert F.max_staleness(gen, step) <= s
    with pytest.raises(ValueError, match="staleness bound 0"):
        F.async_step_seconds(5, 3, 1, 12, 0)
    assert math.isfinite(F.async_step_seconds(5, 3, 1, 12, 1)[0])
