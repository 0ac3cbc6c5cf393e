"""TEGroupedMLP expert LoRA (moe_lora_rl/lora/grouped.py, attach_te_grouped) needs Transformer Engine's grouped
linears, which exist only on GPU machines; nothing of it can run here."""
import pytest


def test_te_grouped_expert_lora():
    pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine (GPU only) is not installed; "
                        "TEGroupedMLP cannot be built on a CPU machine")
    pytest.skip("a GPU run of the TEGroupedMLP path against SequentialMLP (as tests/distributed/"
                "test_lora_grouped.py does for GroupedMLP) is not automated on this CI")
