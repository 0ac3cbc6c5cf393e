"""The hybrid family's shard kinds (megatron/hf_load_hybrid.py through load.assemble) against hand-built expectations:
every row of a tiny arch (head dims 1) is labelled, so a layout is written out row by row. Qwen3-Next's unfusing is
also checked against transformers' own fix_query_key_value_ordering."""
import dataclasses

import pytest
import torch

from moe_lora_rl.megatron.hf_load import ShardSpec, assemble
from moe_lora_rl.models.arch import arch_from_hf_config
from moe_lora_rl.models.tiny import build_hf_config

# 4 query heads in 2 groups, 2 key / 4 value delta-net heads; every head one row wide
ARCH = dataclasses.replace(arch_from_hf_config(build_hf_config("qwen3_5_moe", "tiny")), head_dim=1,
                           linear_key_head_dim=1, linear_value_head_dim=1)
CODES = {"q": 100, "g": 200, "k": 300, "v": 400, "z": 500, "b": 600, "a": 700}


def rows(*names: str) -> torch.Tensor:
    """One row per name ('q3' -> 103), two columns (the second negated) so a transposition would show."""
    vals = torch.tensor([float(CODES[n[0]] + int(n[1:])) for n in names])
    return torch.stack([vals, -vals], dim=1)


def test_plus_one_adds_one():
    w = torch.tensor([0.0, -0.5, 2.0])
    assert torch.equal(assemble("plus_one", [w], ARCH, ShardSpec(1, 2), 0), torch.tensor([1.0, 0.5, 3.0]))


def test_qkv_gated_per_group_query_gate_key_value():
    q_proj = rows("q0", "g0", "q1", "g1", "q2", "g2", "q3", "g3")        # HF: per head [query, gate]
    k, v = rows("k0", "k1"), rows("v0", "v1")
    full = rows("q0", "q1", "g0", "g1", "k0", "v0", "q2", "q3", "g2", "g3", "k1", "v1")
    assert torch.equal(assemble("qkv_gated", [q_proj, k, v], ARCH, ShardSpec(0, 1), 0), full)
    assert torch.equal(assemble("qkv_gated", [q_proj, k, v], ARCH, ShardSpec(1, 2), 0), full[6:])


HF_IN = [rows("q0", "q1", "k0", "k1", "v0", "v1", "v2", "v3"), rows("z0", "z1", "z2", "z3"),
         rows("b0", "b1", "b2", "b3"), rows("a0", "a1", "a2", "a3")]


def test_gdn_in_splits_each_section_over_tp():
    assert torch.equal(assemble("gdn_in", HF_IN, ARCH, ShardSpec(0, 1), 0), torch.cat(HF_IN))
    # rank 1 of 2: key head 1 and the value heads 2, 3 that repeat_interleave pairs with it
    assert torch.equal(assemble("gdn_in", HF_IN, ARCH, ShardSpec(1, 2), 0),
                       rows("q1", "k1", "v2", "v3", "z2", "z3", "b2", "b3", "a2", "a3"))


def test_gdn_in_next_unfuses_per_key_head():
    qkvz = rows("q0", "k0", "v0", "v1", "z0", "z1", "q1", "k1", "v2", "v3", "z2", "z3")
    ba = rows("b0", "b1", "a0", "a1", "b2", "b3", "a2", "a3")
    for shard in (ShardSpec(0, 1), ShardSpec(0, 2), ShardSpec(1, 2)):
        assert torch.equal(assemble("gdn_in_next", [qkvz, ba], ARCH, shard, 0),
                           assemble("gdn_in", HF_IN, ARCH, shard, 0)), shard


def test_gdn_conv_splits_q_k_v_channels():
    conv = rows("q0", "q1", "k0", "k1", "v0", "v1", "v2", "v3").unsqueeze(1)     # [channels, 1, K=2]
    assert torch.equal(assemble("gdn_conv", [conv], ARCH, ShardSpec(0, 1), 0), conv)
    assert torch.equal(assemble("gdn_conv", [conv], ARCH, ShardSpec(1, 2), 0), conv[[1, 3, 6, 7]])


def test_unfused_next_weights_give_transformers_q_k_v_z_b_a():
    """hf_load_hybrid.unfuse_next on real in_proj_qkvz / in_proj_ba weights = transformers' fix_query_key_value_ordering
    applied to their outputs."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from moe_lora_rl.megatron.hf_load_hybrid import unfuse_next

    cfg = build_hf_config("qwen3_next", "tiny")
    arch = arch_from_hf_config(cfg)
    torch.manual_seed(0)
    net = Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    x = torch.randn(1, 3, cfg.hidden_size)
    with torch.no_grad():
        ref = net.fix_query_key_value_ordering(net.in_proj_qkvz(x), net.in_proj_ba(x))
        qkv, z, b, a = unfuse_next(net.in_proj_qkvz.weight, net.in_proj_ba.weight, arch)
        k = arch.linear_num_key_heads * arch.linear_key_head_dim
        got = [*(x @ qkv.t()).split([k, k, qkv.shape[0] - 2 * k], dim=-1), x @ z.t(), x @ b.t(), x @ a.t()]
    for name, r, g in zip("qkvzba", ref, got):
        assert torch.allclose(r.reshape(g.shape), g, rtol=0, atol=1e-6), name


def test_unknown_hybrid_kind_is_an_internal_error():
    from moe_lora_rl.megatron import hf_load_hybrid as load_hybrid

    with pytest.raises(AssertionError, match="gdn_out"):
        load_hybrid.assemble("gdn_out", [], ARCH, 0, 1)
