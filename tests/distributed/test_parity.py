"""Megatron at every layout vs HF transformers, fp32 logits, both tiny models (one torchrun launch per world size).

Tolerance 1e-4 absolute on logits of magnitude ~5: fp32 reduction-order differences between the two implementations
(measured ~2e-5); a wrong shard, expert id or layer offset gives differences of order 1.
"""
import pytest

from moe_lora_rl.checks.layouts import DEFAULT_LAYOUTS, resolve_models
from moe_lora_rl.checks.parity import run
from moe_lora_rl.checks.tolerances import PARITY_FP32 as TARGET

pytestmark = pytest.mark.dist


def test_parity_all_layouts_both_models():
    models = resolve_models(None)
    result = run(models, DEFAULT_LAYOUTS)
    assert set(result["layouts"]) == set(DEFAULT_LAYOUTS.split(","))
    for layout, per_model in result["per_model"].items():
        assert set(per_model) == set(models)
        for model, diff in per_model.items():
            assert 0 <= diff <= TARGET, (layout, model, diff)


def test_bad_layout_fails_before_any_process_starts():
    models = resolve_models(None)
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts"):
        run(models, "ep3")
    with pytest.raises(ValueError, match="pp=3 does not divide num_layers"):
        run(models, "pp3")
