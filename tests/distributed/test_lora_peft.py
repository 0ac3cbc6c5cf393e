"""Adapters trained in Megatron (per_expert and shared_outer) export to PEFT with global expert ids; HF transformers
+ peft then gives Megatron+LoRA's logits within 1e-4 (fp32 logits of magnitude ~20; peft's unmerged LoRA adds
~2e-5 of rounding). A deliberately dropped expert adapter must break the match."""
import pytest
import torch

from moe_lora_rl.checks.layouts import resolve_models
from moe_lora_rl.checks.lora_layouts import REFERENCE, peft_diff, run
from moe_lora_rl.checks.tolerances import PEFT_BROKEN_MIN, PEFT_LOGITS
from moe_lora_rl.lora import LoRAConfig

pytestmark = pytest.mark.dist


def _all_expert_names(model_dir) -> set:
    """(layer, expert, projection, factor) for every routed expert of every MoE layer."""
    from moe_lora_rl.models.arch import load_arch

    arch = load_arch(model_dir)
    return {(layer, e, p, f) for layer, moe in enumerate(arch.moe_layers) if moe for e in range(arch.num_experts)
            for p in ("gate_proj", "up_proj", "down_proj") for f in "AB"}


def _peft_expert_names(peft_dir) -> set:
    import re

    from safetensors import safe_open

    with safe_open(str(peft_dir / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    hits = (re.search(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.lora_([AB])", k)
            for k in keys)
    return {(int(h[1]), int(h[2]), h[3], h[4]) for h in hits if h}


@pytest.mark.slow          # the adapters' PEFT export is served and checked in tests/e2e/test_refit_vllm.py
@pytest.mark.parametrize("layout,layouts", [("per_expert", (REFERENCE, "ep4")), ("shared_outer", (REFERENCE,))])
def test_peft_export_matches_megatron(tmp_path, layout, layouts):
    cfg = LoRAConfig(rank=4, alpha=8.0, adapter_layout=layout)
    models = resolve_models(None)
    run(models, ",".join(layouts), cfg, tmp_path)             # the ep4 export must also be complete (names equal)
    for i, m in enumerate(models):
        for lay in layouts:
            d = peft_diff(m, tmp_path / f"{lay}-m{i}.pt", cfg, tmp_path / f"peft-{lay}-{i}")
            assert d <= PEFT_LOGITS, (m, lay, d)
            assert _peft_expert_names(tmp_path / f"peft-{lay}-{i}") == _all_expert_names(m), (m, lay)
        if layout == "per_expert":
            blob = torch.load(tmp_path / f"{layouts[-1]}-m{i}.pt")
            key = next(k for k in blob["adapters"] if ".experts.3.linear_fc2.lora_B" in k)
            blob["adapters"][key] = torch.zeros_like(blob["adapters"][key])
            torch.save(blob, tmp_path / f"broken-m{i}.pt")
            assert peft_diff(m, tmp_path / f"broken-m{i}.pt", cfg, tmp_path / f"peft-broken-{i}") > PEFT_BROKEN_MIN
