"""The planner reads the MLA linears' shapes from a configuration through the naming tables (plan/specs.py
attention_modules), not from constants: Kimi-K2's, DeepSeek-V3's and Moonlight's configs give the module names and
(in, out) the refit and weight-sync calculators state by hand, and each module's bytes are named in the output."""
from moe_lora_rl.plan.specs import (DEEPSEEK_V3_CONFIG, KIMI_K2_CONFIG, MOONLIGHT_CONFIG, PRESETS, attention_modules,
                                    spec_from_config)
from moe_lora_rl.plan.refit_calc import SPECS
from moe_lora_rl.plan.sync_calc import MORE_SPECS


def test_mla_shapes_from_configs():
    assert attention_modules(KIMI_K2_CONFIG) == (
        ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
         "self_attn.o_proj"), SPECS["kimi-k2"].attention)
    assert attention_modules(DEEPSEEK_V3_CONFIG)[1] == MORE_SPECS["deepseek-v3"].attention
    names, shapes = attention_modules(MOONLIGHT_CONFIG)
    assert dict(zip(names, shapes)) == {"self_attn.q_proj": (2048, 16 * 192), "self_attn.kv_a_proj_with_mqa":
                                        (2048, 576), "self_attn.kv_b_proj": (512, 16 * 256),
                                        "self_attn.o_proj": (16 * 128, 2048)}
    # any config.json: the shapes follow its values (a changed rank changes exactly the modules it sizes)
    wider = dict(zip(*attention_modules({**KIMI_K2_CONFIG, "q_lora_rank": 1024})))
    assert wider["self_attn.q_a_proj"] == (7168, 1024) and wider["self_attn.q_b_proj"] == (1024, 12288)
    assert wider["self_attn.kv_b_proj"] == (512, 16384)


def test_module_bytes_named_in_the_output():
    m = PRESETS["kimi-k2"]()
    b = m.attention_bytes(16)
    assert list(b) == list(attention_modules(KIMI_K2_CONFIG)[0])
    assert b["self_attn.kv_b_proj"] == {"in": 512, "out": 16384, "layers": 61, "base_bytes": 61 * 512 * 16384 * 1,
                                        "adapter_bytes": 61 * 16 * (512 + 16384) * 2}      # fp8 base, bf16 adapter
    gqa = spec_from_config("toy", {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                                   "num_key_value_heads": 1, "num_experts": 4, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 4, "vocab_size": 16}, "test")
    assert list(gqa.attention_bytes(2)) == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                            "self_attn.o_proj"]
