"""Per-expert LoRA on the legacy GroupedMLP (pure-torch grouped GEMM on CPU) trains exactly like SequentialMLP at
the unsharded reference: same losses and adapters after 3 steps (1e-5), and loads the SequentialMLP checkpoint.
TEGroupedMLP needs Transformer Engine (GPU) and is not exercised here."""
import pytest

from moe_lora_rl.checks.layouts import resolve_models
from moe_lora_rl.checks.lora_layouts import run
from moe_lora_rl.checks.tolerances import LORA_LAYOUT, LORA_LOGITS
from moe_lora_rl.lora import LoRAConfig
from moe_lora_rl.megatron.cpu_support import mcore_version

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_version().startswith("0.16."),
                                                   reason="the legacy GroupedMLP was removed in megatron-core 0.19")]


@pytest.mark.slow
def test_grouped_matches_sequential(tmp_path):
    report = run(resolve_models(None), "tp1ep1pp1,tp2ep2etp2", LoRAConfig(rank=4, alpha=8.0), tmp_path,
                 grouped=True)
    r = report["per_layout"]["tp2ep2etp2"]
    for m, rec in r.items():
        assert rec["init_diff"] == 0.0 and rec["only_adapters_trainable"], (m, rec)
        assert rec["loss_max_diff"] <= LORA_LAYOUT and rec["adapter_max_diff"] <= LORA_LAYOUT, (m, rec)
        assert rec["loaded_logits_max_diff"] <= LORA_LOGITS, (m, rec)
