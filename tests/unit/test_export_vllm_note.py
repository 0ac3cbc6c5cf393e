"""An exported adapter vLLM's own LoRA would partly drop says so in one line (refit/export.vllm_lora_note): an MLA
model's kv_b_proj adapter (absorbed decode never calls the layer), naming the module, the layers and the merge
command; nothing for an adapter without it or a GQA family. The merge it points to refuses what it cannot do."""
import json

import pytest
import torch

from moe_lora_rl.models import get_model
from moe_lora_rl.models.arch import load_arch
from moe_lora_rl.refit.export import vllm_lora_note


def _names(layers, module):
    return [f"base_model.model.model.layers.{l}.self_attn.{module}.lora_{ab}.weight" for l in layers for ab in "AB"]


def test_kv_b_proj_adapter_is_named_in_one_line():
    model = str(get_model("deepseek_v3", "tiny_rope"))
    arch = load_arch(model)
    line = vllm_lora_note(_names([0, 1, 3], "kv_b_proj") + _names([0], "q_a_proj"), arch, "/runs/x/adapter", model)
    assert line is not None and "\n" not in line
    assert "kv_b_proj (3 layers)" in line and "vLLM's own LoRA ignores" in line
    assert f"python -m moe_lora_rl.refit.merged --model {model} --adapter /runs/x/adapter" in line
    # control: the other MLA linears are served by vLLM's LoRA; a GQA model has no kv_b_proj
    assert vllm_lora_note(_names([0, 1], "q_a_proj") + _names([2], "o_proj"), arch, "a", model) is None
    glm = load_arch(str(get_model("glm4_moe", "tiny")))
    assert vllm_lora_note(_names([1], "o_proj"), glm, "a", None) is None


def test_merge_refuses_what_it_cannot_do(tmp_path):
    from safetensors.torch import save_file

    from moe_lora_rl.refit.merged import main, save_merged

    model = get_model("deepseek_v3", "tiny_rope")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    A, B = torch.zeros(4, 512), torch.zeros(4 * 64, 4)
    save_file({_names([0], "kv_b_proj")[0]: A, _names([0], "kv_b_proj")[1]: B}, str(adapter / "adapter_model.safetensors"))
    cfg = {"r": 4, "lora_alpha": 8, "use_rslora": True}
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_rslora=True"):
        save_merged(model, adapter, tmp_path / "out")
    with pytest.raises(ValueError, match="is the base checkpoint itself"):
        save_merged(model, adapter, model)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    assert main(["--model", str(model), "--adapter", str(adapter), "--out", str(model)]) == 2
    assert not (tmp_path / "out").exists()
