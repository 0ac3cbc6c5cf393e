"""scripts/make_hybrid_checkpoint.py (a Qwen3.5-MoE checkpoint written by transformers itself, in a chosen layer
pattern): the project reads the pattern and shapes from its config.json, every stored tensor has a Megatron row, and
the dt_bias drawn as Mamba's; a bad pattern is one line."""
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make_hybrid_checkpoint.py"


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_hybrid_checkpoint", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pattern_is_read_from_the_checkpoint_and_every_tensor_named(tmp_path):
    from safetensors.torch import load_file

    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.models.checkpoint import HFCheckpoint
    from moe_lora_rl.models.naming import Offsets, naming_for

    assert _script().main([str(tmp_path), "--pattern", "FLF"]) == 0
    arch = load_arch(tmp_path)
    assert arch.layer_types == ("full_attention", "linear_attention", "full_attention")
    assert list(arch.linear_layer_ids) == [1]
    ckpt, naming = HFCheckpoint(tmp_path), naming_for(arch.family)
    assert ckpt.left_out == {} and ckpt.weight_map
    for hf in ckpt.weight_map:                                 # every tensor has its Megatron parameter, and back
        meg, i = naming.megatron_param(hf, Offsets())
        assert naming.resolve(meg, Offsets()).hf_names[i] == hf, (hf, meg)
    state = load_file(str(tmp_path / "model.safetensors"))
    dt = torch.nn.functional.softplus(state["model.layers.1.linear_attn.dt_bias"])
    assert 1e-3 * (1 - 1e-5) <= dt.min() and dt.max() <= 0.1 * (1 + 1e-5), dt
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForCausalLM"]


def test_bad_pattern_is_one_line():
    p = subprocess.run([sys.executable, str(SCRIPT), "/tmp/unused", "--pattern", "LXF"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "'LXF'" in p.stderr, p.stderr
