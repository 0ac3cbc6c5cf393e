"""lora.adapter_path's checks and reader (refit/peft_dir.py) on an adapter PEFT itself wrote on the tiny GLM-4.5-style
model (checks/peft_native.py: q/k/v, o and the routed experts, PEFT's fused-expert form). Every refusal is one line
naming the key. The reader's per-expert split gives PEFT's own per-expert delta weights (get_delta_weight) exactly
up to fp32 rounding (measured 2.3e-9 on deltas of ~2e-2); a split with gate and up swapped does not (control)."""
import json
import shutil

import pytest
import torch

from moe_lora_rl.checks.peft_native import perturbed_copy, with_config, write_peft_adapter
from moe_lora_rl.lora import LoRAConfig
from moe_lora_rl.models import get_model
from moe_lora_rl.refit.peft_dir import check_adapter_path, read_peft_dir

OURS = LoRAConfig(rank=4, alpha=8.0, targets=("attention", "experts"))


@pytest.fixture(scope="module")
def model():
    return get_model("glm4_moe", "tiny")


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    return write_peft_adapter(model, tmp_path_factory.mktemp("peft") / "a")


def refused(path, cfg, model, match):
    with pytest.raises(ValueError, match=match) as e:
        check_adapter_path(path, cfg, model)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("actor_rollout_ref.model.lora.adapter_path="), msg
    return msg


def test_accepts_peft_adapter(adapter, model):
    check_adapter_path(adapter, OURS, model)
    check_adapter_path(adapter, OURS, None)            # no local model: the config-only checks


def test_missing_path_and_files(adapter, model, tmp_path):
    refused(tmp_path / "nope", OURS, model, "does not exist")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", OURS, model, "no adapter_config.json")
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(adapter / "adapter_config.json", d)
    refused(d, OURS, model, "no adapter_model.safetensors")
    (d / "adapter_model.bin").write_bytes(b"x")
    refused(d, OURS, model, "safe_serialization=True")


def test_rank_alpha_mismatch(adapter, model):
    refused(adapter, LoRAConfig(rank=8, alpha=8.0, targets=OURS.targets), model, "r=4 differs .*rank=8")
    refused(adapter, LoRAConfig(rank=4, alpha=16.0, targets=OURS.targets), model, r"lora_alpha=8(\.0)? differs")


def test_targets_mismatch(adapter, model):
    msg = refused(adapter, LoRAConfig(rank=4, alpha=8.0), model, "lacks")             # "all": dense, shared too
    assert "shared_fc1" in msg
    refused(adapter, LoRAConfig(rank=4, alpha=8.0, targets=("experts",)), model, r"not targeted: \['proj', 'qkv'\]")


def test_other_model_refused(adapter, model, tmp_path):
    other = get_model("qwen3_moe", "tiny")
    msg = refused(with_config(adapter, tmp_path / "b", base_model_name_or_path=str(other)), OURS, model,
                  "was trained on")
    assert "model_type='qwen3_moe'" in msg or "differs" in msg
    refused(with_config(adapter, tmp_path / "c", auto_mapping={"base_model_class": "Qwen3MoeForCausalLM"}), OURS,
            model, "written for a Qwen3MoeForCausalLM")
    # the same architecture under another path is accepted (the weights may differ; shapes are checked at load)
    same = tmp_path / "same_model"
    shutil.copytree(model, same)
    check_adapter_path(with_config(adapter, tmp_path / "d", base_model_name_or_path=str(same)), OURS, model)


@pytest.mark.parametrize("change,match", [
    (dict(use_dora=True), "use_dora=True"), (dict(use_rslora=True), "use_rslora=True"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"), (dict(bias="all"), "bias='all'"),
    (dict(rank_pattern={"o_proj": 8}), "one rank and scale"),
])
def test_unsupported_peft_options(adapter, model, tmp_path, change, match):
    refused(with_config(adapter, tmp_path / "x", **change), OURS, model, match)


def test_fused_experts_split_equals_peft_delta(adapter, model):
    """Our per-expert factors of every MoE layer give PEFT's own delta weight for every expert."""
    from peft import PeftModel
    import transformers

    from moe_lora_rl.models.arch import load_arch

    arch = load_arch(str(model))
    t = read_peft_dir(adapter, arch, OURS.rank)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(adapter))
    worst, swapped, checked = 0.0, 0.0, 0
    for name, mod in peft.named_modules():
        if getattr(mod, "parameter_name", None) not in ("gate_up_proj", "down_proj"):
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        pre = f"base_model.model.model.layers.{layer}.mlp.experts"
        delta = mod.get_delta_weight("default")                     # [E, out, in]
        parts = ("gate_proj", "up_proj") if mod.parameter_name == "gate_up_proj" else ("down_proj",)
        for e in range(arch.num_experts):
            ours = [t[f"{pre}.{e}.{p}.lora_B.weight"] @ t[f"{pre}.{e}.{p}.lora_A.weight"] * OURS.scale for p in parts]
            worst = max(worst, float((delta[e] - torch.cat(ours)).abs().max()))
            if len(parts) == 2:
                swapped = max(swapped, float((delta[e] - torch.cat(ours[::-1])).abs().max()))
            checked += 1
    assert checked == 2 * arch.num_experts * sum(arch.moe_layers), checked
    assert worst <= 1e-7 and swapped > 1e-3, (worst, swapped)


def test_independent_a_refused(model, tmp_path):
    """An adapter trained with PEFT's defaults (independent q/k/v A's; gate and up A halves independent): refused
    before any model is built (check_adapter_path reads the A tensors), and by the reader."""
    from safetensors.torch import load_file, save_file

    from moe_lora_rl.models.arch import load_arch

    d = write_peft_adapter(model, tmp_path / "indep", shared_a=False)
    refused(d, OURS, model, r"[qkv]_proj.lora_A.weight differs from .*[qkv]_proj.lora_A.weight.*linear_qkv")
    with pytest.raises(ValueError, match="two halves of lora_A differ") as e:
        read_peft_dir(d, load_arch(str(model)), OURS.rank)
    assert "\n" not in str(e.value)
    t = load_file(str(d / "adapter_model.safetensors"))          # q/k/v made to share A: the experts' still differ
    for n in [n for n in t if n.endswith(("k_proj.lora_A.weight", "v_proj.lora_A.weight"))]:
        t[n] = t[n.replace("k_proj", "q_proj").replace("v_proj", "q_proj")].clone()
    save_file(t, str(d / "adapter_model.safetensors"))
    refused(d, OURS, model, "gate_up_proj, rank 8.*different A halves")


def test_perturbed_copy_differs(adapter, tmp_path):
    from safetensors.torch import load_file

    p = perturbed_copy(adapter, tmp_path / "p")
    a, b = load_file(str(adapter / "adapter_model.safetensors")), load_file(str(p / "adapter_model.safetensors"))
    assert sum(not torch.equal(a[k], b[k]) for k in a) == 1
    assert json.loads((p / "adapter_config.json").read_text())["r"] == 4
