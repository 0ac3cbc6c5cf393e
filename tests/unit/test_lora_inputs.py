"""LoRA config validation and bad input, on a single-rank Megatron model (in process, gloo world of 1)."""
import json

import pytest
import torch

from moe_lora_rl.lora import LoRAConfig, adapter_factors, apply_lora, load_sharded, remove_lora, save_sharded
from moe_lora_rl.megatron.layout import Layout


@pytest.mark.parametrize("kw,msg", [
    (dict(rank=0), "rank must be a positive integer, got rank=0"),
    (dict(rank=-2), "rank=-2"),
    (dict(alpha=0), "alpha must be > 0"),
    (dict(dropout=1.0), "dropout must be in"),
    (dict(adapter_layout="per_rank"), "adapter_layout='per_rank'"),
    (dict(targets=("experts", "mlp_magic")), r"unknown LoRA targets \['mlp_magic'\]"),
    (dict(targets=()), "targets is empty"),
    (dict(dtype="int8"), "dtype='int8'"),
])
def test_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LoRAConfig(**kw)


def test_targets_resolve():
    assert LoRAConfig(targets=("experts",)).resolved_targets() == ("expert_fc1", "expert_fc2")
    assert "router" not in LoRAConfig().resolved_targets()
    # "attention" names GQA's, MLA's and the delta-net's linears; a model adapts those it has (apply_lora,
    # MoEArch.adaptable)
    assert set(LoRAConfig(targets=("attention", "dense_fc1")).resolved_targets()) == {
        "qkv", "proj", "q_down", "q_up", "q", "kv_down", "kv_up", "linear_in", "linear_out", "dense_fc1"}


def test_target_matching_nothing_is_refused_and_nothing_applied(qwen):
    m = qwen()
    with pytest.raises(ValueError, match=r"LoRA targets \['dense_mlp'\] match no layer"):
        apply_lora(m, LoRAConfig(targets=("experts", "dense_mlp")))      # qwen3 tiny has no dense MLP layer
    assert not adapter_factors(m) and all(p.requires_grad for p in m.parameters())
    with pytest.raises(ValueError, match="'router'"):
        apply_lora(m, LoRAConfig(targets=("router",)))
    assert not adapter_factors(m)


def test_default_targets_cover_what_exists(qwen):
    m = qwen()
    plans = apply_lora(m, LoRAConfig(rank=2))
    assert {p.target for p in plans} == {"expert_fc1", "expert_fc2", "qkv", "proj"}
    assert sum(p.target.startswith("expert") for p in plans) == 2 * 8 * 2          # layers x experts x fc
    names = {f.lora_meta.global_name for _, f in adapter_factors(m)}
    assert "layers.1.mlp.experts.7.linear_fc1.lora_A" in names
    remove_lora(m)
    assert not adapter_factors(m)


@pytest.mark.parametrize("layout", ["per_expert", "shared"])
def test_adapters_are_built_where_the_base_lives(qwen, layout):
    """A base moved off the CPU (here to the meta device, standing in for CUDA) gets its factors there, own and
    shared alike: factors built on the CPU beside a CUDA base failed the first forward on an H100."""
    m = qwen().to("meta")
    apply_lora(m, LoRAConfig(rank=2, adapter_layout=layout))
    assert {f.device.type for _, f in adapter_factors(m)} == {"meta"}


@pytest.mark.parametrize("layout,shared", [("shared_outer", 2), ("shared", 4)])
def test_shared_layouts_hold_one_factor_per_layer(qwen, layout, shared):
    m = qwen()
    apply_lora(m, LoRAConfig(rank=2, targets=("experts",), adapter_layout=layout))
    names = [f.lora_meta.global_name for _, f in adapter_factors(m)]
    assert len(names) == len(set(names))
    per_layer_shared = [n for n in names if n.startswith("layers.0.mlp.experts.linear_fc")]
    assert len(per_layer_shared) == shared, per_layer_shared


def test_checkpoint_mismatch_is_refused_and_nothing_loaded(qwen, tmp_path):
    m = qwen()
    apply_lora(m, LoRAConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        for _, f in adapter_factors(m):
            f.add_(0.5)
    save_sharded(m, tmp_path / "ck")
    for other, what in ((LoRAConfig(rank=8, alpha=8.0), "rank"), (LoRAConfig(rank=4, alpha=16.0), "alpha"),
                        (LoRAConfig(rank=4, alpha=8.0, adapter_layout="shared_outer"), "adapter_layout"),
                        (LoRAConfig(rank=4, alpha=8.0, targets=("experts",)), "targets")):
        m2 = qwen()
        apply_lora(m2, other)
        before = {n: f.detach().clone() for n, f in adapter_factors(m2)}
        with pytest.raises(ValueError, match=f"LoRA {what} mismatch"):
            load_sharded(m2, tmp_path / "ck")
        assert all(torch.equal(before[n], f) for n, f in adapter_factors(m2))


def test_checkpoint_missing_expert_is_refused_and_nothing_loaded(qwen, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    m = qwen()
    apply_lora(m, LoRAConfig(rank=4, alpha=8.0))
    save_sharded(m, tmp_path / "ck")
    f = next((tmp_path / "ck").glob("adapter-*.safetensors"))
    with safe_open(f, "pt") as s:
        meta = json.loads(s.metadata()["moe_lora_rl"])
        tensors = {k: s.get_tensor(k) for k in s.keys()}
    drop = [k for k in tensors if "experts.5.linear_fc2.lora_B" in k and k.startswith("layers.1.")]
    assert drop
    for k in drop:
        tensors.pop(k), meta.pop(k)
    save_file(tensors, str(f), metadata={"moe_lora_rl": json.dumps(meta)})
    m2 = qwen()
    apply_lora(m2, LoRAConfig(rank=4, alpha=8.0))
    before = {n: t.detach().clone() for n, t in adapter_factors(m2)}
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.5\.linear_fc2\.lora_B .*missing"):
        load_sharded(m2, tmp_path / "ck")
    assert all(torch.equal(before[n], t) for n, t in adapter_factors(m2))


def test_experts_not_dividing_ep_refused():
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=8"):
        Layout.parse("ep3").check_model(num_layers=2, num_heads=4, num_kv_heads=2, num_experts=8, moe_ffn=64, ffn=None)


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer", "shared"])
def test_refit_calculator_counts_the_adapters_megatron_builds(qwen, layout):
    from moe_lora_rl.plan.refit_calc import MoESpec, expert_adapter_params, other_adapter_params

    m = qwen()
    apply_lora(m, LoRAConfig(rank=2, adapter_layout=layout))
    built = sum(f.numel() for _, f in adapter_factors(m))
    # qwen3_moe tiny: 2 MoE layers, 8 experts, hidden 128, expert FFN 64; fused qkv 128 -> (4+2+2)*32, o 128 -> 128
    spec = MoESpec("qwen3_moe-tiny", 2, 2, 8, 128, 64, attention=((128, 256), (128, 128)))
    assert built == expert_adapter_params(spec, 2, layout) + other_adapter_params(spec, 2)
