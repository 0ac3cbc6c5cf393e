"""What an MLA checkpoint gets before a vLLM engine starts (vllm/mla_config.py): DeepSeek-V3's routing keys where
config.json lacks them (one line), the CPU MLA backend, and a refusal of latent / rope widths the CPU decode kernel
cannot run (vLLM itself fails only at the first decode step, with "Unsupported block size: 16")."""
import json

import pytest

from moe_lora_rl.vllm.mla_config import engine_args, engine_settings, engine_settings_for

BASE = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 64}


def test_missing_routing_keys_get_deepseek_v3_values_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    overrides, kw, lines = engine_settings_for(tmp_path, cpu=True)
    assert overrides == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    assert kw == {"attention_backend": "CPU_MLA"}
    assert len(lines) == 1 and "topk_method" in lines[0] and "sigmoid" in lines[0]


def test_keys_the_checkpoint_sets_are_kept():
    overrides, _, lines = engine_settings({**BASE, "topk_method": "noaux_tc"}, cpu=True)
    assert overrides == {"scoring_func": "sigmoid"} and len(lines) == 1
    assert engine_settings({**BASE, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}, cpu=True)[::2] == ({}, [])


@pytest.mark.parametrize("kv,rope", [(256, 64), (512, 32)])
def test_widths_the_cpu_decode_kernel_cannot_run_are_refused(kv, rope):
    cfg = {**BASE, "kv_lora_rank": kv, "qk_rope_head_dim": rope}
    with pytest.raises(ValueError, match=rf"kv_lora_rank {kv} and qk_rope_head_dim {rope}.*runs only kv_lora_rank "
                                         r"512 with qk_rope_head_dim 64"):
        engine_settings(cfg, cpu=True)
    assert engine_settings(cfg, cpu=False)[1] == {}          # GPU backends have no such limit: not ours to refuse


def test_other_architectures_untouched(tmp_path):
    assert engine_settings({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe"}, cpu=True) == \
        ({}, {}, [])
    assert engine_settings_for(tmp_path, cpu=True) == ({}, {}, [])          # no config.json: vLLM's own error


def test_engine_args_the_callers_values_win(tmp_path):
    """What make_engine and verl's rollout server pass to vLLM: ours beneath the caller's, per key."""
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    kw, lines = engine_args(tmp_path, {"dtype": "float32"}, cpu=True)
    assert kw == {"dtype": "float32", "attention_backend": "CPU_MLA",
                  "hf_overrides": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}} and len(lines) == 1
    kw, _ = engine_args(tmp_path, {"attention_backend": "TORCH_SDPA", "hf_overrides": {"scoring_func": "softmax"}},
                        cpu=True)
    assert kw == {"attention_backend": "TORCH_SDPA", "hf_overrides": {"topk_method": "noaux_tc",
                                                                     "scoring_func": "softmax"}}
    assert "attention_backend" not in engine_args(tmp_path, {"attention_config": {}}, cpu=True)[0]
    assert "attention_backend" not in engine_args(tmp_path, {}, cpu=False)[0]            # CPU backend on CPU only
    assert engine_args(tmp_path / "none", {"dtype": "float32"}, cpu=True) == ({"dtype": "float32"}, [])
