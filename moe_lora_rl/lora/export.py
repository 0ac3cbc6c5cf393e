"""Export gathered adapters to the HF PEFT adapter format, with global expert ids.

    gather TP/ETP -> collect EP/PP (state.gather_adapters) -> rename to PEFT per family table -> split fused factors
    (qkv -> q/k/v, fc1 -> gate/up, A shared by the split parts) -> expand shared-by-experts factors per expert -> save

The result is a standard module-level PEFT LoRA adapter: base_model.model.model.layers.L.<module>.lora_{A,B}.weight,
lora_A [r, in], lora_B [out, r], scale lora_alpha / r.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..models.arch import MoEArch
from .config import LoRAConfig

PREFIX = "base_model.model.model."

# canonical module (after "layers.L.") -> HF module(s); "{E}" = global expert id
MODULES: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
    "mlp.shared_experts.linear_fc1": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
    "mlp.shared_experts.linear_fc2": ("mlp.shared_experts.down_proj",),
    "mlp.experts.{E}.linear_fc1": ("mlp.experts.{E}.gate_proj", "mlp.experts.{E}.up_proj"),
    "mlp.experts.{E}.linear_fc2": ("mlp.experts.{E}.down_proj",),
}
_CANON = re.compile(r"^layers\.(\d+)\.(.+)\.lora_([AB])$")


def _split_B(module: str, B: torch.Tensor, arch: MoEArch) -> list[torch.Tensor]:
    if module.endswith("linear_qkv"):
        g, hd = arch.num_kv_heads, arch.head_dim
        per = B.reshape(g, -1, hd, B.shape[-1])                    # [groups, q_per_group + 2, hd, r]
        q, k, v = per[:, :-2], per[:, -2], per[:, -1]
        return [q.reshape(-1, B.shape[-1]), k.reshape(-1, B.shape[-1]), v.reshape(-1, B.shape[-1])]
    if B.dim() == 3:                                               # GLU [2, ffn, r] -> gate, up
        return [B[0], B[1]]
    return [B]


def to_peft_tensors(adapters: dict[str, torch.Tensor], arch: MoEArch) -> dict[str, torch.Tensor]:
    """Canonical global adapters -> PEFT tensor names. Factors shared by all experts are copied to every expert."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in adapters.items():
        m = _CANON.match(name)
        if not m:
            raise ValueError(f"adapter tensor {name!r} is not in canonical form layers.L.<module>.lora_A|B")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    # shared-across-experts factors: layers.L.mlp.experts.linear_fcN -> fill every expert's missing factor
    for (layer, module), fac in list(pairs.items()):
        s = re.match(r"^mlp\.experts\.(linear_fc[12])$", module)
        if not s:
            continue
        pairs.pop((layer, module))
        for e in range(arch.num_experts):
            key = (layer, f"mlp.experts.{e}.{s.group(1)}")
            pairs.setdefault(key, {})
            for ab, t in fac.items():
                if ab in pairs[key]:
                    raise ValueError(f"layer {layer} expert {e}: factor {ab} is both shared and per-expert")
                pairs[key][ab] = t
    out: dict[str, torch.Tensor] = {}
    for (layer, module), fac in sorted(pairs.items()):
        if set(fac) != {"A", "B"}:
            raise ValueError(f"layer {layer} {module}: incomplete adapter, has {sorted(fac)}")
        e = re.match(r"^mlp\.experts\.(\d+)\.(.+)$", module)
        key = f"mlp.experts.{{E}}.{e.group(2)}" if e else module
        if key not in MODULES:
            raise ValueError(f"no PEFT name for adapter module {module!r}")
        hf_mods = [h.replace("{E}", e.group(1)) if e else h for h in MODULES[key]]
        Bs = _split_B(module, fac["B"], arch)
        assert len(Bs) == len(hf_mods), (module, len(Bs))
        for hf, B in zip(hf_mods, Bs):
            out[f"{PREFIX}layers.{layer}.{hf}.lora_A.weight"] = fac["A"].clone()  # A is shared by the split parts
            out[f"{PREFIX}layers.{layer}.{hf}.lora_B.weight"] = B.clone()
    return out


# Dense-MLP and shared-expert projections share their names with the routed experts' projections; peft 0.21 moves
# every gate/up/down_proj target onto the fused expert parameters of transformers 5 MoE models, so these 2D weights
# must be named in target_parameters to keep their adapters (vLLM reads tensor names and ignores both lists).
_MLP_PARAMS = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
               "mlp.shared_experts.down_proj.weight")


def peft_config(cfg: LoRAConfig, tensors: dict[str, torch.Tensor], base_model: str | None) -> dict:
    modules = {k[len(PREFIX):].rsplit(".lora_", 1)[0] for k in tensors}
    targets = sorted({m.split(".")[-1] for m in modules})
    params = sorted({p for m in modules if ".experts." not in m or ".shared_experts." in m
                     for p in _MLP_PARAMS if f"{m}.weight".endswith("." + p)})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": 0.0, "bias": "none", "target_modules": targets, "target_parameters": params or None,
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": None, "base_model_name_or_path": base_model, "inference_mode": True,
            "rank_pattern": {}, "alpha_pattern": {}}


def save_peft(adapters: dict[str, torch.Tensor], arch: MoEArch, cfg: LoRAConfig, out_dir: str | Path,
              base_model: str | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_peft_tensors(adapters, arch)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(peft_config(cfg, tensors, base_model), indent=1))
    return out
