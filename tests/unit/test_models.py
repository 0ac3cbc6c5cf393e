"""The project's model factories: deterministic, cached, loadable in HF transformers, of the sizes promised."""
import torch
import transformers
from safetensors.torch import load_file

from moe_lora_rl.models import get_model
from moe_lora_rl.models.tiny import _write, build_hf_config


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
