import pytest

from moe_lora_rl.models.arch import arch_from_hf_config
from moe_lora_rl.models.tiny import build_hf_config


def test_qwen3_moe_arch():
    a = arch_from_hf_config(build_hf_config("qwen3_moe", "tiny"))
    assert a.moe_layers == (True, True) and a.score_function == "softmax" and not a.pre_softmax
    assert a.num_experts == 8 and a.topk == 2 and a.qk_norm and a.shared_expert_ffn == 0 and a.rotary_percent == 1.0


def test_glm4_moe_arch_has_deepseek_routing():
    a = arch_from_hf_config(build_hf_config("glm4_moe", "tiny"))
    assert a.moe_layers == (False, True, True, True)          # leading dense layer
    assert a.moe_layer_ids == [1, 2, 3]
    assert a.score_function == "sigmoid" and a.expert_bias and a.num_experts >= 16
    assert (a.num_groups, a.group_topk, a.scaling_factor) == (4, 2, 2.5)
    assert a.shared_expert_ffn == 32 and a.rotary_percent == 0.5 and a.qkv_bias


def test_unsupported_architecture():
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForCausalLM'\] not supported.*Glm4MoeForCausalLM"):
        arch_from_hf_config({"architectures": ["LlamaForCausalLM"]})


def test_unreproducible_routing_is_refused():
    cfg = build_hf_config("glm4_moe", "tiny")
    cfg.norm_topk_prob = False
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        arch_from_hf_config(cfg)
    cfg = build_hf_config("glm4_moe", "tiny")
    cfg.topk_group = 1
    with pytest.raises(ValueError, match="n_group=4, topk_group=1, num_experts_per_tok=4"):
        arch_from_hf_config(cfg)


def test_rope_scaling_refused():
    cfg = build_hf_config("qwen3_moe", "tiny")
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        arch_from_hf_config(cfg)
