"""Megatron at every layout vs HF transformers, fp32 logits, both tiny GQA models and the three MLA (deepseek_v3)
variants (yarn as Kimi-K2, plain RoPE with an MTP layer in the checkpoint, q_lora_rank null as Moonlight), in one
torchrun launch per world size.

Tolerance 1e-4 absolute on logits of magnitude ~5: fp32 reduction-order differences between the two implementations
(measured ~2e-5; MLA under TP ~6e-5); a wrong shard, expert id or layer offset gives differences of order 1.
Negative controls for MLA at the unsharded layout: the same model built without its latent norms, and the yarn model
with plain RoPE, must miss the tolerance.
"""
import pytest

from moe_lora_rl.checks.layouts import DEFAULT_LAYOUTS, mla_models, resolve_models
from moe_lora_rl.checks.parity_run import run
from moe_lora_rl.checks.tolerances import PARITY_FP32 as TARGET

pytestmark = pytest.mark.dist


def test_parity_all_layouts_all_models():
    models = resolve_models(None) + mla_models()
    result = run(models, DEFAULT_LAYOUTS)
    assert set(result["layouts"]) == set(DEFAULT_LAYOUTS.split(","))
    for layout, per_model in result["per_model"].items():
        assert set(per_model) == set(models)
        for model, diff in per_model.items():
            assert 0 <= diff <= TARGET, (layout, model, diff)
    controls = result["mla_controls"]["tp1ep1pp1"]
    assert set(controls) == set(mla_models())
    for model, c in controls.items():
        assert set(c) == ({"no_latent_norms", "plain_rope"} if model.split("/")[-1].startswith("deepseek_v3-tiny-")
                          else {"no_latent_norms"}), (model, c)
        assert all(v > 10 * TARGET for v in c.values()), (model, c)


def test_bad_layout_fails_before_any_process_starts():
    models = resolve_models(None)
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts"):
        run(models, "ep3")
    with pytest.raises(ValueError, match="pp=3 does not divide num_layers"):
        run(models, "pp3")


def test_mla_tp_that_does_not_divide_fails_before_any_process_starts():
    with pytest.raises(ValueError, match=r"tp=8 does not divide num_attention_heads=4"):
        run(mla_models()[:1], "tp8")
    from moe_lora_rl.megatron.build import check_layout
    from moe_lora_rl.megatron.layout import Layout
    from moe_lora_rl.models.arch import load_arch

    arch = load_arch(mla_models()[0])
    import dataclasses

    odd = dataclasses.replace(arch, num_heads=8, num_kv_heads=8, q_lora_rank=60)
    with pytest.raises(ValueError, match=r"tp=8 does not divide the MLA down projection's rows q_lora_rank=60"):
        check_layout(odd, Layout.parse("tp8"))
