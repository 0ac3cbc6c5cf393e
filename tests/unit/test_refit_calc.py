"""Refit calculator formulas against hand-computed cases and against adapters actually built in Megatron."""
import pytest

from moe_lora_rl.refit.calc import SPECS, MoESpec, base_params, expert_adapter_params, other_adapter_params, refit_report
from moe_lora_rl.refit.plan import plan_buckets

TOY = MoESpec("toy", num_layers=2, moe_layers=1, experts=4, hidden=10, expert_ffn=3, shared_ffn=2, dense_ffn=5,
              vocab=7, attention=((10, 6), (6, 10)))


def test_hand_computed_toy():
    # per_expert: 1 layer * 4 experts * r(2*10 + 3*3) = 4 * 29 r; r = 2 -> 232
    assert expert_adapter_params(TOY, 2, "per_expert") == 232
    # shared_outer: r(2H + 3EF) = 2 * (20 + 36) = 112 ; shared: r(2H + 3F) = 2 * 29 = 58
    assert expert_adapter_params(TOY, 2, "shared_outer") == 112
    assert expert_adapter_params(TOY, 2, "shared") == 58
    # other: attention 2 layers * r*(16+16) = 128; shared expert 1 * 2*(20+6) = 52; dense 1 * 2*(20+15) = 70
    assert other_adapter_params(TOY, 2) == 128 + 52 + 70
    # base: experts 4*3*10*3=360, shared 3*10*2=60, router 40, dense 150, attention 2*120=240,
    #       norms 2*2*10+10=50, embeddings 2*7*10=140
    assert base_params(TOY) == 360 + 60 + 40 + 150 + 240 + 50 + 140


def test_kimi_k2_orders_of_magnitude():
    k = SPECS["kimi-k2"]
    assert 1.0e12 <= base_params(k) <= 1.1e12                     # "1T parameters"
    per_expert_r128 = expert_adapter_params(k, 128, "per_expert")
    assert per_expert_r128 == 60 * 384 * 128 * (2 * 7168 + 3 * 2048)   # ~60.4B: the 60-82B anchor range
    rep = refit_report(k, link_gbps=25.0)
    assert rep["adapters"]["shared/r8"]["bytes"] < rep["adapters"]["shared_outer/r8"]["bytes"] \
        < rep["adapters"]["per_expert/r8"]["bytes"] < rep["base_bytes"]
    assert rep["adapters"]["per_expert/r32"]["refit_s"] == pytest.approx(
        rep["adapters"]["per_expert/r32"]["bytes"] / 25e9)


def test_bad_layout():
    with pytest.raises(ValueError, match="adapter layout 'per_rank'"):
        expert_adapter_params(TOY, 2, "per_rank")


def test_bucket_plan():
    sizes = {f"base_model.model.model.layers.{l}.x{i}.lora_A.weight": 40 for l in (10, 2) for i in range(3)}
    plan = plan_buckets(5, sizes, bucket_bytes=100)
    assert plan.total_bytes == 240 and sum(b.nbytes for b in plan.buckets) == 240
    assert [len(b.names) for b in plan.buckets] == [2, 2, 2]
    assert plan.names[0].startswith("base_model.model.model.layers.2.")        # layer-major order
    assert sorted(plan.names) == sorted(sizes)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(1, sizes, 0)
