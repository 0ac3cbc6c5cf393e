"""The planner and refit calculators on the hybrid family (Qwen3.5/3.6-MoE): base parameters against transformers'
own model of the tiny config (built on the meta device), adapter counts per LoRA target against the naming table's
shapes counted by hand, the recurrent state against vLLM's state shapes, and the concurrency the hybrid buys."""
from dataclasses import replace

import pytest
import torch

from moe_lora_rl.models.arch import arch_from_hf_config
from moe_lora_rl.models.naming import qwen3_5_moe
from moe_lora_rl.models.naming.tables import dims
from moe_lora_rl.models.tiny import build_hf_config
from moe_lora_rl.plan import formulas as F
from moe_lora_rl.plan.cli import main
from moe_lora_rl.plan.refit_calc import DeltaNet, MoESpec, expert_adapter_params, other_adapter_params
from moe_lora_rl.plan.search import rollout_layouts, seq_bytes_per_gpu
from moe_lora_rl.plan.specs import PRESETS, RLSettings, Hardware, spec_from_config


@pytest.fixture(scope="module")
def tiny():
    cfg = build_hf_config("qwen3_5_moe", "tiny")
    assert cfg.layer_types.count("linear_attention") == 3            # both kinds of layer are counted
    return cfg


def test_base_params_equal_the_hf_models_count(tiny):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny)
    n = sum(p.numel() for p in model.parameters())
    spec = spec_from_config("tiny", tiny.to_dict(), "test")
    assert spec.total_params == n
    # the released layout: the same text tower nested as text_config
    vl = spec_from_config("tiny", {"text_config": tiny.to_dict(), "tie_word_embeddings": False}, "test")
    assert vl.moe == spec.moe
    # each base piece the hybrid adds is counted: drop it and the count is off by exactly that piece
    H, m = tiny.hidden_size, spec.moe
    gdn = m.delta_net
    assert gdn.other_params == gdn.conv_dim * tiny.linear_conv_kernel_dim + 2 * tiny.linear_num_value_heads \
        + tiny.linear_value_head_dim
    from moe_lora_rl.plan.refit_calc import base_params
    assert base_params(replace(m, shared_gate=False)) == n - m.moe_layers * H
    assert base_params(replace(m, attention_norms=0)) == n - 2 * tiny.head_dim * m.full_layers


def _by_hand(cfg, r: int) -> dict[str, int]:
    """r (in + out) per HF module of the naming table, in the layers that hold it; a GLU fc1 (gate|up) has one A."""
    arch = arch_from_hf_config(cfg)
    d, kinds = dims(arch), arch.layer_types
    layers = {"linear_attention": kinds.count("linear_attention"), "attention": kinds.count("full_attention"),
              "shared": sum(arch.moe_layers), "expert": sum(arch.moe_layers) * arch.num_experts}
    out = {}
    for li in qwen3_5_moe.NAMING.linears:
        if li.part == "dense":
            continue
        ins, outs = li.io
        parts = outs.split("|") if "|" in outs else [outs] * len(li.hf)
        if li.target in ("shared_fc1", "expert_fc1"):          # gate|up: one A [r, in], one B [2 ffn, r]
            n = r * (d[ins] + sum(d[p] for p in parts))
        else:
            n = sum(r * (d[ins] + d[p]) for p in parts)
        out[li.target] = layers[li.part] * n
    return out


def test_adapter_params_per_target_by_hand(tiny):
    r = 8
    spec = spec_from_config("tiny", tiny.to_dict(), "test")
    hand = _by_hand(tiny, r)
    assert set(hand) == {"linear_in", "linear_out", "qkv", "proj", "shared_fc1", "shared_fc2", "expert_fc1",
                         "expert_fc2"}
    got = {k: v // 2 for k, v in spec.target_bytes(r).items()}   # bytes at bf16 -> params
    assert got == hand
    assert sum(hand.values()) == expert_adapter_params(spec.moe, r, "per_expert") + other_adapter_params(spec.moe, r)
    # the pieces named in the brief: in_proj over qkv|z|b|a, the gated q_proj (2 x heads x head_dim out)
    H, K, V = tiny.hidden_size, 2 * 32, 4 * 32
    assert hand["linear_in"] == 3 * r * ((H + 2 * K + V) + (H + V) + 2 * (H + 4))
    mods = spec.attention_bytes(r)
    assert (mods["self_attn.q_proj"]["out"], mods["self_attn.q_proj"]["layers"]) == (2 * 4 * 32, 1)
    assert [mods[f"linear_attn.in_proj_{p}"]["out"] for p in ("qkv", "z", "b", "a")] == [2 * K + V, V, 4, 4]


def test_recurrent_state_and_kv_of_the_presets():
    m = PRESETS["qwen3.6-35b-a3b"]()
    # vLLM's gated_delta_net_state_shape: conv (kernel - 1) x (2 K + V), temporal (num_v_heads, dv, dk); bf16
    conv, temporal = 3 * (2 * 16 * 128 + 32 * 128), 32 * 128 * 128
    assert m.state_bytes_per_seq == 30 * (conv + temporal) * 2 == 32_931_840
    assert m.kv_bytes_per_token == 2 * 10 * 2 * 256 * 2 == 20_480              # the 10 full layers only
    big = PRESETS["qwen3.5-397b-a17b"]()
    assert (big.moe.linear_layers, big.moe.full_layers) == (45, 15)
    assert big.state_bytes_per_seq == 45 * (3 * (2 * 16 * 128 + 64 * 128) + 64 * 128 * 128) * 2
    assert big.kv_bytes_per_token == 2 * 15 * 2 * 256 * 2
    # the released totals, text tower without MTP: 397B / 17B active and 35B / 3B active
    assert round(big.total_params / 1e9) == 396 and round(big.active_params / 1e9) == 17
    assert round(m.total_params / 1e9) == 35 and round(m.active_params / 1e9, 1) == 3.5
    assert replace(PRESETS["qwen3.5-35b-a3b"]().moe, name=m.moe.name) == m.moe


def test_concurrency_counts_the_state_beside_the_kv():
    assert F.kv_concurrency(1000, 1, 100) == 10
    assert F.kv_concurrency(1000, 1, 100, state_bytes_per_seq_per_gpu=150) == 4
    m = PRESETS["qwen3.6-35b-a3b"]()
    # the same model with every layer full attention: no state, four times the KV per token
    all_att = spec_from_config("all", {"text_config": {**_config36(), "layer_types": ["full_attention"] * 40}}, "test")
    assert all_att.state_bytes_per_seq == 0 and all_att.kv_bytes_per_token == 4 * m.kv_bytes_per_token
    assert "linear_in" not in all_att.target_bytes(8) and all_att.moe.delta_net is None
    rl, hw = RLSettings(prompt_len=1024, response_len=8192, rank=32), Hardware()
    hyb = {(r.engine_gpus, r.tp): r for r in rollout_layouts(m, hw, rl, 8, 2)}[(8, 2)]
    free = hyb.memory_GB["kv_cache"] * 1e9
    # tp2 halves the KV (2 KV heads) and the state (conv channels and value heads split)
    seq = m.kv_bytes_per_token / 2 * rl.seq_len + m.state_bytes_per_seq / 2
    assert seq_bytes_per_gpu(m, 2, rl.seq_len) == seq
    assert hyb.concurrency == 4 * min(int(free // seq), rl.max_engine_concurrency)     # 4 attention-DP ranks
    # at 1024 + 8192 tokens a hybrid sequence holds 3.4x fewer bytes than the all-attention one
    ratio = (all_att.kv_bytes_per_token * rl.seq_len) / (m.kv_bytes_per_token * rl.seq_len + m.state_bytes_per_seq)
    assert 3.4 < ratio < 3.41


def _config36() -> dict:
    from moe_lora_rl.plan.specs import QWEN3_6_35B_A3B_CONFIG
    return dict(QWEN3_6_35B_A3B_CONFIG["text_config"])


def test_refusals():
    with pytest.raises(ValueError, match="linear_layers=3 needs a delta_net"):
        MoESpec("x", 4, 4, 8, 16, 8, linear_layers=3)
    with pytest.raises(ValueError, match="layer_types"):
        spec_from_config("x", {**_config36(), "layer_types": ["linear_attention"] * 39}, "test")
    assert DeltaNet(2, 4, 32, 32, 4).conv_dim == 2 * 64 + 128


def test_cli_prints_the_hybrid(capsys):
    assert main(["--model", "qwen3.6-35b-a3b", "--gpus", "16", "--rank", "32", "--batch", "256"]) == 0
    out = capsys.readouterr().out
    assert "recurrent state" in out and "linear_in" in out
