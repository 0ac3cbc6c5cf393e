"""MLA (deepseek_v3) names: both variants (q_lora_rank set / null) round-trip HF <-> Megatron <-> canonical <-> PEFT
<-> vLLM under PP/EP; hand-written rows pin the table itself (vLLM's fused_qkv_a_proj slices, the shapes); the MTP
layer's tensors are split off by name and never reach a backbone parameter; the arch reader refuses what
megatron-core cannot reproduce; LoRA targets accept verl's names. The names against megatron-bridge's DeepSeek-V3
mappings are checked in test_bridge_mla_names.py (Python 3.12 env)."""
import pytest
import torch

from moe_lora_rl.models.arch import arch_from_hf_config
from moe_lora_rl.models.checkpoint import HFCheckpoint
from moe_lora_rl.models.naming import MEGATRON, AdapterName, Offsets, VllmName, naming_for, owner, split_mtp
from moe_lora_rl.models.tiny import SPECS, build_hf_config, mtp_tensors

SIZES = ("tiny", "tiny_rope", "tiny_lite")
ARCHS = {s: arch_from_hf_config(build_hf_config("deepseek_v3", s)) for s in SIZES}


@pytest.mark.parametrize("size", ["tiny", "tiny_lite"])
@pytest.mark.parametrize("pp,ep", [(1, 1), (2, 4)])
def test_mla_adapter_names_round_trip(size, pp, ep):
    arch = ARCHS[size]
    naming = naming_for(arch)
    targets = set()
    for layer in range(arch.num_layers):
        for li in naming.layer_linears(arch, layer):
            for e in (range(arch.num_experts) if li.part == "expert" else [None]):
                name = AdapterName(li, layer, e)
                targets.add(li.target)
                _, _, off = owner(layer, e, num_layers=arch.num_layers, pp=pp, num_experts=arch.num_experts, ep=ep)
                local = naming.to_megatron(name, off)
                assert naming.from_megatron(local, off) == name
                assert MEGATRON.find_megatron(local, off).canonical == name.canonical      # family-free naming
                for ab in "AB":
                    assert naming.parse_canonical(f"{name.canonical}.lora_{ab}") == (name, ab)
                    for p, part in naming.peft_names(name, ab, arch.num_experts):
                        assert naming.parse_peft(p) == (name, part, ab)
                        assert naming.from_vllm(naming.to_vllm(name, part)) == (name, part)
    mla = {"q_down", "q_up", "kv_down", "kv_up", "proj"} if size == "tiny" else {"q", "kv_down", "kv_up", "proj"}
    assert targets == mla | {"dense_fc1", "dense_fc2", "shared_fc1", "shared_fc2", "expert_fc1", "expert_fc2"}
    assert targets == arch.adaptable()


def test_mla_hand_written_rows():
    full, lite = naming_for(ARCHS["tiny"]), naming_for(ARCHS["tiny_lite"])
    assert naming_for("deepseek_v3") is full                      # callers without an arch: DeepSeek-V3's variant
    off = Offsets(2, 0)                                           # pp2: stage 1's local layer 0 is global layer 2
    kv = full.from_megatron("decoder.layers.0.self_attention.linear_kv_down_proj", off)
    assert kv.canonical == "layers.2.self_attention.linear_kv_down_proj"
    assert full.peft_names(kv, "B", 16) == [
        ("base_model.model.model.layers.2.self_attn.kv_a_proj_with_mqa.lora_B.weight", 0)]
    assert full.to_vllm(kv, 0) == VllmName("model.layers.2.self_attn.fused_qkv_a_proj", None, 1)
    qd = full.from_megatron("decoder.layers.0.self_attention.linear_q_down_proj", off)
    assert full.to_vllm(qd, 0) == VllmName("model.layers.2.self_attn.fused_qkv_a_proj", None, 0)
    assert full.from_vllm(VllmName("model.layers.2.self_attn.fused_qkv_a_proj", None, 1)) == (kv, 0)
    assert full.vllm_linears()["self_attn.fused_qkv_a_proj"] == ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")
    kv_lite = lite.from_megatron("decoder.layers.0.self_attention.linear_kv_down_proj", off)
    assert lite.to_vllm(kv_lite, 0) == VllmName("model.layers.2.self_attn.kv_a_proj_with_mqa", None, 0)
    q = lite.from_megatron("decoder.layers.0.self_attention.linear_q_proj", off)
    assert lite.to_vllm(q, 0) == VllmName("model.layers.2.self_attn.q_proj", None, 0)
    up = full.from_megatron("decoder.layers.1.self_attention.linear_kv_up_proj", Offsets())
    assert full.to_vllm(up, 0) == VllmName("model.layers.1.self_attn.kv_b_proj", None, 0)
    # shapes: hidden 256, 4 heads, q_lora 64, kv_lora 512, nope 32, rope 64, v 32
    s = full.hf_shapes(ARCHS["tiny"], 1)
    assert (s["self_attn.q_a_proj"], s["self_attn.q_b_proj"], s["self_attn.kv_a_proj_with_mqa"],
            s["self_attn.kv_b_proj"], s["self_attn.o_proj"]) == ((256, 64), (64, 384), (256, 576), (512, 256),
                                                                 (128, 256))
    assert lite.hf_shapes(ARCHS["tiny_lite"], 0)["self_attn.q_proj"] == (256, 384)
    r = full.resolve("decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight", Offsets(3, 0))   # TE spec
    assert r.hf_names == ("model.layers.3.self_attn.q_a_layernorm.weight",)
    assert full.resolve("decoder.layers.0.self_attention.kv_layernorm.weight", Offsets()).hf_names == \
        ("model.layers.0.self_attn.kv_a_layernorm.weight",)
    assert full.megatron_param("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", Offsets(1, 0)) == \
        ("decoder.layers.0.self_attention.linear_kv_down_proj.weight", 0)
    assert lite.megatron_param("model.layers.1.self_attn.q_proj.weight", Offsets()) == \
        ("decoder.layers.1.self_attention.linear_q_proj.weight", 0)
    for bad in (lambda: full.from_vllm(VllmName("model.layers.0.self_attn.fused_qkv_a_proj", None, 2)),
                lambda: full.from_vllm(VllmName("model.layers.0.self_attn.kv_a_proj_with_mqa", None, 0)),
                lambda: lite.from_vllm(VllmName("model.layers.0.self_attn.fused_qkv_a_proj", None, 0)),
                lambda: full.megatron_param("model.layers.0.self_attn.q_proj.weight", Offsets()),
                lambda: lite.parse_peft("base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight")):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("size", SIZES)
def test_mla_checkpoint_names_and_mtp(size):
    """Every backbone tensor of the real checkpoint maps to its owner's Megatron parameter and back (pp2 ep2); the
    MTP layer's tensors (tiny_rope: num_nextn_predict_layers 1) are exactly the ones split off."""
    from moe_lora_rl.models import get_model

    arch = ARCHS[size]
    naming = naming_for(arch)
    names = list(HFCheckpoint(get_model("deepseek_v3", size)).weight_map)
    backbone, mtp = split_mtp(names, arch.num_layers)
    assert arch.mtp_layers == SPECS[("deepseek_v3", size)]["num_nextn_predict_layers"]
    assert sorted(mtp) == sorted(mtp_tensors(backbone, arch.num_layers, arch.mtp_layers))
    assert len(mtp) == (0 if size != "tiny_rope" else sum(n.startswith("model.layers.3.") for n in backbone) + 6)
    for hf in backbone:
        bits = hf.split(".")
        layer = int(bits[2]) if bits[1] == "layers" else 0
        expert = int(bits[5]) if ".mlp.experts." in hf else None
        _, _, off = owner(layer, expert, num_layers=arch.num_layers, pp=2, num_experts=arch.num_experts, ep=2)
        meg, i = naming.megatron_param(hf, off)
        assert naming.resolve(meg, off).hf_names[i] == hf
    if mtp:   # negative control: by layer number alone an MTP tensor would land on a backbone-shaped parameter
        meg, _ = naming.megatron_param("model.layers.4.self_attn.kv_b_proj.weight", Offsets(2, 0))
        assert meg == "decoder.layers.2.self_attention.linear_kv_up_proj.weight"


def _cfg(**over):
    return {**build_hf_config("deepseek_v3", "tiny").to_dict(), **over}


@pytest.mark.parametrize("over,match", [
    (dict(rope_interleave=False), "rope_interleave=False"),
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(kv_lora_rank=None), "kv_lora_rank=None"),
    (dict(q_lora_rank=0), "q_lora_rank=0"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type='longrope'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "original_max_position_embeddings": 4096, "attention_factor": 0.5}),
     "attention_factor=0.5"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "original_max_position_embeddings": 4096, "mscale": 0.7}), "mscale=0.7"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "original_max_position"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
])
def test_mla_arch_refusals(over, match):
    with pytest.raises(ValueError, match=match):
        arch_from_hf_config(_cfg(**over))


def test_mla_arch_facts():
    a, lite, rope = ARCHS["tiny"], ARCHS["tiny_lite"], ARCHS["tiny_rope"]
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (64, 512, 32, 64,
                                                                                                     32)
    assert a.rope_type == "yarn" and dict(a.yarn) == {
        "factor": 32.0, "original_max_position_embeddings": 4096.0, "beta_fast": 1.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0} and a.rope_theta == 50000.0
    assert rope.rope_type == "default" and rope.yarn == () and rope.mtp_layers == 1 and rope.mtp_layer_ids == [4]
    assert lite.q_lora_rank is None and lite.num_groups is None and lite.mla
    assert a.moe_layers == (False, True, True, True) and a.shared_expert_ffn == 32 and a.scaling_factor == 2.5
    # DeepSeek-V3's own yarn: factor 40, beta_fast 32, mscale_all_dim 1 (read from rope_scaling, the released key)
    ds = arch_from_hf_config(_cfg(rope_parameters=None, rope_scaling={
        "type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}, rope_theta=10000.0))
    assert dict(ds.yarn)["factor"] == 40.0 and dict(ds.yarn)["beta_fast"] == 32.0 and ds.rope_theta == 10000.0


def test_mla_lora_targets():
    from moe_lora_rl.lora.config import TARGETS, LoRAConfig

    assert {"q_down", "q_up", "q", "kv_down", "kv_up"} <= set(TARGETS)
    verl = LoRAConfig(targets=("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                               "linear_proj", "linear_fc1"))
    assert set(verl.resolved_targets()) == {"q_down", "q_up", "kv_down", "kv_up", "proj", "dense_fc1", "shared_fc1",
                                            "expert_fc1"}
    att = set(LoRAConfig(targets=("attention",)).resolved_targets())
    assert att & ARCHS["tiny"].adaptable() == {"q_down", "q_up", "kv_down", "kv_up", "proj"}
    assert att & ARCHS["tiny_lite"].adaptable() == {"q", "kv_down", "kv_up", "proj"}
    LoRAConfig(targets=("linear_q_proj", "attention")).check_model(ARCHS["tiny_lite"].adaptable())
    with pytest.raises(ValueError, match=r"\['q_up', 'linear_q_down_proj'\] name no linear .* accepts .*'q'"):
        LoRAConfig(targets=("q_up", "linear_q_down_proj", "kv_up")).check_model(ARCHS["tiny_lite"].adaptable())
    with pytest.raises(ValueError, match=r"\['linear_qkv'\] name no linear"):
        LoRAConfig(targets=("linear_qkv",)).check_model(ARCHS["tiny"].adaptable())
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        LoRAConfig(targets=("linear_q_b_proj",))


def test_mla_peft_export_shapes():
    """A canonical MLA factor becomes one PEFT tensor of the HF module's shape (single-part linears: copied)."""
    from moe_lora_rl.refit.rename import to_peft_tensors

    arch, r = ARCHS["tiny"], 3
    shapes = naming_for(arch).hf_shapes(arch, 1)
    meg = {"q_a_proj": "linear_q_down_proj", "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa":
           "linear_kv_down_proj", "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}
    adapters = {}
    for hf, m in meg.items():
        i, o = shapes["self_attn." + hf]
        adapters[f"layers.1.self_attention.{m}.lora_A"] = torch.randn(r, i)
        adapters[f"layers.1.self_attention.{m}.lora_B"] = torch.randn(o, r)
    out = to_peft_tensors(adapters, arch)
    for hf, m in meg.items():
        assert torch.equal(out[f"base_model.model.model.layers.1.self_attn.{hf}.lora_B.weight"],
                           adapters[f"layers.1.self_attention.{m}.lora_B"])
