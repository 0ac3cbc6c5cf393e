"""The project's model factories: deterministic, cached, loadable in HF transformers, of the sizes promised."""
import pytest
import torch
import transformers
from safetensors.torch import load_file

from moe_lora_rl.models import get_model
from moe_lora_rl.models.tiny import SPECS, _write, build_hf_config


def _params(family, size):
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(build_hf_config(family, size))
    return sum(p.numel() for p in m.parameters())


def test_sizes():
    for fam in ("qwen3_moe", "glm4_moe"):
        assert 0.3e6 < _params(fam, "tiny") < 2e6
        assert 100e6 <= _params(fam, "medium") <= 200e6


def test_deterministic_from_seed(tmp_path):
    for d, seed in (("a", 0), ("b", 0), ("c", 1)):
        (tmp_path / d).mkdir()
        _write(tmp_path / d, "glm4_moe", "tiny", seed)
    a, b, c = (load_file(tmp_path / d / "model.safetensors") for d in "abc")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.1.mlp.gate.weight"], c["model.layers.1.mlp.gate.weight"])


def test_cached_and_loadable():
    for fam in ("qwen3_moe", "glm4_moe"):
        p = get_model(fam)
        assert get_model(fam) == p                       # cached: same directory, not rebuilt
        tok = transformers.AutoTokenizer.from_pretrained(p)
        ids = tok("Question: what is 12 + 34? Answer:", return_tensors="pt").input_ids
        assert tok.decode(ids[0]) == "Question: what is 12 + 34? Answer:"
        m = transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
        out = m(ids).logits
        assert out.shape == (1, ids.shape[1], m.config.vocab_size) and torch.isfinite(out).all()
        # routing is non-degenerate: different tokens reach different experts
        w = load_file(next(p.glob("*.safetensors")))
        gate = [k for k in w if k.endswith("mlp.gate.weight")]
        assert gate and all(w[k].std() > 0.01 for k in gate)


def test_glm_checkpoint_has_deepseek_routing_tensors():
    w = load_file(next(get_model("glm4_moe").glob("*.safetensors")))
    assert "model.layers.0.mlp.gate_proj.weight" in w                 # dense first layer
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in w
    bias = w["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.shape == (16,) and bias.abs().max() > 0


def test_wide_is_the_realistic_routing_default():
    """128 fine-grained routed experts, top-8 within 4 of 8 groups and a shared expert (DeepSeek-V3's routing at a
    small scale), as many active routed parameters per token as "small", small enough for 2 CPU cores."""
    from moe_lora_rl.models.arch import arch_from_hf_config
    from moe_lora_rl.rl.config import ModelSettings

    arch = arch_from_hf_config(build_hf_config("glm4_moe", "wide"))
    small = arch_from_hf_config(build_hf_config("glm4_moe", "small"))
    assert (arch.num_experts, arch.topk, arch.num_groups, arch.group_topk) == (128, 8, 8, 4)
    assert arch.score_function == "sigmoid" and arch.expert_bias and arch.shared_expert_ffn > 0
    assert arch.topk * arch.moe_ffn_hidden_size == small.topk * small.moe_ffn_hidden_size
    assert 10e6 < _params("glm4_moe", "wide") < 25e6
    assert ModelSettings().size == "wide" and ("glm4_moe", "small") in SPECS     # the former default, by name


def test_routing_spec_errors_name_the_value():
    from moe_lora_rl.models.tiny import check_routing

    wide = SPECS[("glm4_moe", "wide")]
    for bad, match in (({"num_experts_per_tok": 65}, r"num_experts_per_tok=65 is more than the 4 of 8 groups allow "
                                                     r"\(4 x 16 experts\)"),
                       ({"n_group": 6}, "n_group=6 does not divide the 128 routed experts"),
                       ({"topk_group": 9}, r"topk_group=9 must be in 1..n_group=8"),
                       ({"n_routed_experts": 0}, "routed experts=0 must be a positive integer")):
        with pytest.raises(ValueError, match=match):
            check_routing("glm4_moe", "x", {**wide, **bad})
    with pytest.raises(ValueError, match=r"num_experts_per_tok=64 with topk_group=4: HF scores a group by its top-2"):
        check_routing("glm4_moe", "x", {**wide, "num_experts_per_tok": 64})      # fits the groups, not the builder
    check_routing("glm4_moe", "x", {**wide, "num_experts_per_tok": 4, "topk_group": 2})
    with pytest.raises(ValueError, match=r"no model spec 'glm4_moe'/'huge'"):
        build_hf_config("glm4_moe", "huge")
