"""The streaming refit plan (pure) on synthetic owner maps: buckets per sender within the budget, every factor sent
once, sizes counted in PEFT bytes; bad owner maps and budgets are ValueErrors naming the tensor or expert."""
import pytest

from moe_lora_rl.lora import LoRAConfig
from moe_lora_rl.models.arch import arch_from_hf_config
from moe_lora_rl.models.tiny import build_hf_config
from moe_lora_rl.refit.stream_plan import FactorReport, expected_factors, plan_stream
from moe_lora_rl.refit.rename import peft_outputs

ARCH = arch_from_hf_config(build_hf_config("glm4_moe", "tiny"))     # 4 layers (first dense), 16 experts, shared
CFG = LoRAConfig(rank=4, alpha=8.0)


def _shape(factor: str) -> tuple[int, ...]:
    r, h, a = 4, ARCH.hidden_size, ARCH
    qkv = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    ffn = {"mlp.linear": a.ffn_hidden_size, "mlp.shared_experts": a.shared_expert_ffn}
    f = next((v for k, v in ffn.items() if k in factor), a.moe_ffn_hidden_size)
    if factor.endswith("linear_qkv.lora_A") or factor.endswith("fc1.lora_A"):
        return (r, h)
    if factor.endswith("linear_qkv.lora_B"):
        return (qkv, r)
    if factor.endswith("linear_proj.lora_A"):
        return (r, a.num_heads * a.head_dim)
    if factor.endswith("fc1.lora_B"):
        return (2, f, r)
    if factor.endswith("fc2.lora_A"):
        return (r, f)
    return (h, r)


def _reports(world=4, ep=2, drop=None, both=None):
    """Experts split over `ep` senders (ranks 0..ep-1), everything else sent by rank 0 (a replicated layout)."""
    reports = [[] for _ in range(world)]
    per = ARCH.num_experts // ep
    for f in sorted(expected_factors(ARCH, CFG)):
        if f == drop:
            continue
        e = int(f.split(".")[4]) if ".experts." in f and f.split(".")[4].isdigit() else None
        owner = 0 if e is None else e // per
        reports[owner].append(FactorReport(f, _shape(f), None, (owner,), True))
        if f == both:
            reports[owner + 1].append(FactorReport(f, _shape(f), None, (owner + 1,), True))
    return reports


def test_plan_buckets_per_sender_within_budget():
    plan = plan_stream(_reports(), ARCH, 16384, expected_factors(ARCH, CFG))
    names = [u.factor for b in plan.buckets for u in b.units]
    assert sorted(names) == sorted(expected_factors(ARCH, CFG)) and len(names) == len(set(names))
    for b in plan.buckets:
        assert b.nbytes <= 16384 and {u.sender for u in b.units} == {b.sender}
    peft = sum(sum(4 * o.shape[0] * o.shape[1] for o in peft_outputs(ARCH, f, _shape(f)))
               for f in expected_factors(ARCH, CFG))
    assert plan.total_bytes == peft == plan.send_bytes(0) + plan.send_bytes(1)
    assert plan.send_bytes(2) == plan.send_bytes(3) == 0
    # expert 9 of layer 2 is on EP rank 1: every bucket with it is sent by rank 1
    assert {b.sender for b in plan.buckets for u in b.units if u.factor.startswith("layers.2.mlp.experts.9.")} == {1}


def test_expected_factors_by_adapter_layout():
    per = expected_factors(ARCH, CFG)
    outer = expected_factors(ARCH, LoRAConfig(rank=4, adapter_layout="shared_outer"))
    shared = expected_factors(ARCH, LoRAConfig(rank=4, adapter_layout="shared"))
    assert "layers.1.mlp.experts.15.linear_fc2.lora_B" in per and "layers.0.mlp.linear_fc1.lora_A" in per
    assert "layers.0.mlp.experts.0.linear_fc1.lora_A" not in per                      # layer 0 is dense
    assert {"layers.1.mlp.experts.linear_fc1.lora_A", "layers.1.mlp.experts.3.linear_fc1.lora_B",
            "layers.1.mlp.experts.linear_fc2.lora_B", "layers.1.mlp.experts.3.linear_fc2.lora_A"} <= outer
    assert "layers.1.mlp.experts.3.linear_fc1.lora_A" not in outer
    assert not any(".experts.3." in f for f in shared)
    # attention 4 layers x 4 + dense layer 0 x 4 + shared expert 3 x 4 = 32 factors, plus over 3 MoE layers:
    # per_expert 16 experts x 4, shared_outer 2 shared + 2 x 16, shared 4
    assert (len(per), len(outer), len(shared)) == (32 + 3 * 64, 32 + 3 * 34, 32 + 3 * 4)


def test_owner_map_leaving_an_expert_unsent():
    f = "layers.2.mlp.experts.11.linear_fc2.lora_B"
    with pytest.raises(ValueError, match=r"no rank holds adapter factor expert 11 of layer 2 "
                                         r"\(layers\.2\.mlp\.experts\.11\.linear_fc2\.lora_B\)"):
        plan_stream(_reports(drop=f), ARCH, 1 << 20, expected_factors(ARCH, CFG))
    reports = _reports()                                          # held, but its replica set has no sender
    reports[1] = [r if r.factor != f else FactorReport(f, r.shape, None, (1,), False) for r in reports[1]]
    with pytest.raises(ValueError, match=r"owner map: no rank sends adapter factor expert 11 of layer 2"):
        plan_stream(reports, ARCH, 1 << 20, expected_factors(ARCH, CFG))
    with pytest.raises(ValueError, match=r"owner map: ranks \[0, 1\] all send adapter factor expert 3 of layer 1"):
        plan_stream(_reports(both="layers.1.mlp.experts.3.linear_fc1.lora_A"), ARCH, 1 << 20)


def test_bucket_smaller_than_largest_tensor():
    # the largest unit: the dense MLP's fc1 B ([2, 256, 4] fp32) as gate and up = 8192 bytes
    with pytest.raises(ValueError, match=r"bucket_bytes=8191 is smaller than adapter tensor "
                                         r"layers\.0\.mlp\.linear_fc1\.lora_B \(8192 bytes as 2 PEFT tensors\)"):
        plan_stream(_reports(), ARCH, 8191)
    plan_stream(_reports(), ARCH, 8192)
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer"):
        plan_stream(_reports(), ARCH, 0)
