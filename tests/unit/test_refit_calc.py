"""Refit calculator formulas against hand-computed cases and against adapters actually built in Megatron."""
import pytest

from moe_lora_rl.plan.refit_calc import (SPECS, MoESpec, base_params, expert_adapter_params, other_adapter_params,
                                         refit_report)
from moe_lora_rl.transfer.push_plan import plan_buckets

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


def test_streaming_hand_computed_toy():
    from moe_lora_rl.plan.refit_calc import streaming_report

    rep = streaming_report(TOY, 2, "pp2ep2", bucket_bytes=1000, bytes_per_param=2)
    # one layer per stage, the MoE one: 2 of 4 experts * r(3H + 3F) = 2 * 2 * 39 = 156; attention 2*(16+16) = 64;
    # shared expert r(3H + 3S) = 2 * 36 = 72 -> 292 params sent; own shard 2*2*29 + 64 + 2*26 = 232
    assert rep["per_rank_send_bytes"] == 292 * 2
    assert rep["per_rank_peak_bytes"] == 1000 + 232 * 2
    assert rep["all_gather_object_per_rank_bytes"] == (232 + 250) * 2
    # the largest tensor: the dense fc1's A [2, 10] copied to gate and up = 40 params
    with pytest.raises(ValueError, match=r"bucket_bytes=79 is smaller than toy's largest adapter tensor \(80 bytes\)"):
        streaming_report(TOY, 2, "pp2ep2", bucket_bytes=79)
    with pytest.raises(ValueError, match="ep3 does not divide toy's 4 experts"):
        streaming_report(TOY, 2, "ep3", bucket_bytes=1000)
    with pytest.raises(ValueError, match="'tp2xp2' is not a combination"):
        streaming_report(TOY, 2, "tp2xp2", bucket_bytes=1000)


def test_streaming_formula_matches_the_plan():
    """The formula's busiest sender equals the streaming planner's on tiny GLM4 at pp2ep2 (rank = stage*2 + EP rank;
    the stage's non-expert factors sent by its EP rank 0)."""
    from moe_lora_rl.lora import LoRAConfig
    from moe_lora_rl.models.arch import arch_from_hf_config
    from moe_lora_rl.models.tiny import build_hf_config
    from moe_lora_rl.plan.refit_calc import streaming_report
    from moe_lora_rl.refit.stream_plan import FactorReport, expected_factors, plan_stream

    a = arch_from_hf_config(build_hf_config("glm4_moe", "tiny"))
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    spec = MoESpec("glm4-tiny", a.num_layers, sum(a.moe_layers), a.num_experts, a.hidden_size, a.moe_ffn_hidden_size,
                   shared_ffn=a.shared_expert_ffn, dense_ffn=a.ffn_hidden_size,
                   attention=((a.hidden_size, q), (a.hidden_size, kv), (a.hidden_size, kv), (q, a.hidden_size)))
    r = 4
    cfg = LoRAConfig(rank=r)
    reports = [[] for _ in range(4)]
    for f in expected_factors(a, cfg):
        layer = int(f.split(".")[1])
        parts = f.split(".")
        e = int(parts[4]) if parts[3] == "experts" and parts[4].isdigit() else None
        stage = layer // 2
        rank = stage * 2 + (0 if e is None else e // (a.num_experts // 2))
        reports[rank].append(FactorReport(f, _canonical_shape(a, f, r), None, (rank,), True))
    plan = plan_stream(reports, a, 1 << 20, expected_factors(a, cfg))
    rep = streaming_report(spec, r, "pp2ep2", bucket_bytes=1 << 20, bytes_per_param=4)
    assert max(plan.send_bytes(k) for k in range(4)) == rep["per_rank_send_bytes"] == plan.send_bytes(2)


def _canonical_shape(a, f: str, r: int) -> tuple[int, ...]:
    h, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    ffn = a.ffn_hidden_size if ".mlp.linear_" in f else a.shared_expert_ffn if "shared_experts" in f \
        else a.moe_ffn_hidden_size
    if f.endswith("linear_qkv.lora_A") or f.endswith("fc1.lora_A"):
        return (r, h)
    if f.endswith("linear_qkv.lora_B"):
        return (q + 2 * kv, r)
    if f.endswith("linear_proj.lora_A"):
        return (r, q)
    if f.endswith("linear_proj.lora_B") or f.endswith("fc2.lora_B"):
        return (h, r)
    if f.endswith("fc1.lora_B"):
        return (2, ffn, r)
    return (r, ffn)                                        # fc2 A
