"""verl's override_transformer_config -> TransformerConfig kwargs (megatron/transformer_options.py): the recompute
settings honoured, attention_backend accepted, everything else refused in one line naming the key; and the kwargs
accepted by megatron-core 0.16.1's TransformerConfig for a real model (its own validation runs)."""
import pytest

from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.megatron import moe_options
from moe_lora_rl.megatron.run_config import RunConfig
from moe_lora_rl.megatron.transformer_options import (ACCEPTED, HONOURED, KEY, SELECTIVE_MODULES, check_for_model,
                                                      transformer_options)

VERL_DEFAULT = {"recompute_granularity": None, "recompute_modules": ["core_attn"], "recompute_method": None,
                "recompute_num_layers": None, "attention_backend": "flash"}
VERL_LORA_EXAMPLE = {"recompute_method": "uniform", "recompute_granularity": "full", "recompute_num_layers": 1}


def test_verl_default_is_no_recompute():
    assert transformer_options(VERL_DEFAULT) == {}
    assert transformer_options(None) == {} and transformer_options({}) == {}


def test_verl_lora_example_is_full_uniform_recompute():
    assert transformer_options({**VERL_DEFAULT, **VERL_LORA_EXAMPLE}) == VERL_LORA_EXAMPLE


def test_selective_modules():
    got = transformer_options({"recompute_granularity": "selective", "recompute_modules": ["moe", "layernorm", "moe"]})
    assert got == {"recompute_granularity": "selective", "recompute_modules": ["moe", "layernorm"]}
    assert transformer_options({"recompute_granularity": "selective"})["recompute_modules"] == ["core_attn"]


@pytest.mark.parametrize("override, text", [
    ({"moe_permute_fusion": True}, f"{KEY}.moe_permute_fusion=True: Transformer Engine"),
    ({"moe_router_fusion": True}, "bypasses router replay"),
    ({"apply_rope_fusion": True}, f"{KEY}.apply_rope_fusion=True: not an option moe_lora_rl honours"),
    ({"recompute_granularity": "all"}, f"{KEY}.recompute_granularity='all': choose one of"),
    ({"recompute_method": "uniform"}, "without recompute_granularity recomputes nothing"),
    ({"recompute_granularity": "full", "recompute_num_layers": 1}, "recompute_method=None with"),
    ({"recompute_granularity": "full", "recompute_method": "block"}, "recompute_num_layers=None with"),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 0}, "give an int >= 1"),
    ({"recompute_granularity": "selective", "recompute_method": "uniform"}, "only with full granularity"),
    ({"recompute_granularity": "selective", "recompute_modules": []}, "recomputes nothing"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}, "SequentialMLP"),
    ({"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]}, "MLA path"),
    ({"recompute_granularity": "selective", "recompute_modules": ["attn"]}, "contains 'attn': choose from"),
])
def test_refusals_are_one_line_naming_the_key(override, text):
    """Through the section's one entry (moe_options.transformer_overrides), which hands recompute keys here."""
    with pytest.raises(ValueError) as e:
        moe_options.transformer_overrides(override, Layout(), RunConfig())
    assert text in str(e.value) and "\n" not in str(e.value)


def test_every_key_has_one_place():
    assert not (set(HONOURED) & set(ACCEPTED)) and not (set(moe_options.REFUSED) & (set(HONOURED) | set(ACCEPTED)))
    assert moe_options.transformer_overrides({**VERL_DEFAULT, **VERL_LORA_EXAMPLE}, Layout(), RunConfig()) == \
        {"transformer_overrides": VERL_LORA_EXAMPLE}


class _Arch:
    num_layers, moe_layers, shared_expert_ffn = 4, (False, True, True, True), 0


@pytest.mark.parametrize("kw, layout, text", [
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3}, "pp2",
     "exceeds the 2 layers per pipeline stage"),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3}, "tp1",
     "does not divide the 4 layers"),
    ({"recompute_granularity": "selective", "recompute_modules": ["shared_experts"]}, "tp1", "no shared experts"),
])
def test_model_checks(kw, layout, text):
    with pytest.raises(ValueError, match=text):
        check_for_model(kw, _Arch(), Layout.parse(layout))
    check_for_model({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
                    _Arch(), Layout.parse(layout))
    moe_only = type("A", (), {"num_layers": 2, "moe_layers": (True, True), "shared_expert_ffn": 0})()
    with pytest.raises(ValueError, match="every layer of this model is MoE"):
        check_for_model({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, moe_only, Layout())


@pytest.mark.parametrize("override", [VERL_LORA_EXAMPLE, {"recompute_granularity": "selective",
                                                           "recompute_modules": list(SELECTIVE_MODULES)}])
def test_megatron_takes_the_kwargs(override):
    """megatron-core's own TransformerConfig.__post_init__ validation accepts what we pass (glm4_moe tiny)."""
    from moe_lora_rl.megatron.build import transformer_config
    from moe_lora_rl.models import get_model
    from moe_lora_rl.models.arch import load_arch

    cfg = transformer_config(load_arch(str(get_model("glm4_moe", "tiny"))), Layout(), **transformer_options(override))
    for k, v in transformer_options(override).items():
        assert getattr(cfg, k) == v


def test_takes_verl_dictconfig():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({**VERL_DEFAULT, **VERL_LORA_EXAMPLE})
    assert transformer_options(cfg) == VERL_LORA_EXAMPLE
    cfg = omegaconf.OmegaConf.create({**VERL_DEFAULT, "recompute_granularity": "selective",
                                      "recompute_modules": ["moe", "layernorm"]})
    assert transformer_options(cfg)["recompute_modules"] == ["moe", "layernorm"]
