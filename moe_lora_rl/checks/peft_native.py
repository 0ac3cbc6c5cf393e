"""PEFT adapters written by PEFT itself (not by our export) on an HF checkpoint, for the adapter_path tests: PEFT's
LoraConfig on transformers' model, random non-zero A and B, save_pretrained. On a transformers 5 MoE model PEFT
adapts the routed experts through their fused 3-D parameters (target_parameters gate_up_proj / down_proj, gate_up
at rank 2r and alpha 2*alpha); the attention's q/k/v are separate modules. Our LoRA can hold such an adapter when
q/k/v share their A and the two halves of each expert's gate_up A are equal (refit/peft_dir.py): `shared_a` writes
it that way, and False writes independent A's (the refusal case)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_peft_model(model_dir, rank: int, alpha: float, targets=TARGETS):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                             attn_implementation="eager")
    return peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets)))


@torch.no_grad()
def write_peft_adapter(model_dir, out_dir, rank: int = 4, alpha: float = 8.0, seed: int = 0, std: float = 0.3,
                       shared_a: bool = True) -> Path:
    """out_dir: PEFT's save_pretrained of a LoRA on every attention projection and the routed experts, every A and B
    drawn N(0, std^2 / fan-in)."""
    model = hf_peft_model(model_dir, rank, alpha)
    g = torch.Generator().manual_seed(seed)
    shared: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if not (hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {})):
            continue
        a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        a.copy_(torch.randn(a.shape, generator=g) * std / a.shape[1] ** 0.5)
        b.copy_(torch.randn(b.shape, generator=g) * std / b.shape[1] ** 0.5)
        layer = name.split(".layers.")[1].split(".")[0]
        if shared_a and name.endswith(("q_proj", "k_proj", "v_proj")):       # one A for q/k/v (Megatron's linear_qkv)
            a.copy_(shared.setdefault(layer, a.clone()))
        elif shared_a and a.shape[1] == model.config.hidden_size and ".experts" in name:   # gate_up_proj: [E*2r, h]
            e = model.config.n_routed_experts if hasattr(model.config, "n_routed_experts") else model.config.num_experts
            per = a.view(e, -1, a.shape[1])
            per[:, rank:] = per[:, :rank]
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def perturbed_copy(src, dst, eps: float = 0.05, seed: int = 1) -> Path:
    """A copy of the adapter directory SRC with one module's lora_B (the first o_proj) moved by N(0, eps^2)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    t = load_file(str(src / "adapter_model.safetensors"))
    name = sorted(n for n in t if "o_proj.lora_B" in n)[0]
    t[name] = t[name] + eps * torch.randn(t[name].shape, generator=torch.Generator().manual_seed(seed))
    save_file(t, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    return dst


def with_config(src, dst, **changes) -> Path:
    """A copy of SRC with adapter_config.json keys changed (the mismatch cases)."""
    import shutil

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst
