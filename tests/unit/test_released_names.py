"""The released DeepseekV3 checkpoint layout derived from config.json alone (models/released.py): it equals the names
of a real saved checkpoint (the tiny_rope model: per-expert names, an MTP layer), maps onto every layout's Megatron
parameters with fp8 scales paired and the MTP layer skipped by name (DeepSeek-V3's configuration), and refuses what
does not map."""
import pytest

from moe_lora_rl.models.checkpoint import HFCheckpoint
from moe_lora_rl.models.released import map_released, released_names
from moe_lora_rl.plan.specs import DEEPSEEK_V3_CONFIG, KIMI_K2_CONFIG, MOONLIGHT_CONFIG


@pytest.mark.parametrize("size", ["tiny_rope", "tiny_lite"])
def test_derived_names_equal_a_saved_checkpoint(size):
    import json

    from moe_lora_rl.models import get_model

    path = get_model("deepseek_v3", size)
    cfg = json.loads((path / "config.json").read_text())
    assert set(released_names(cfg)) == set(HFCheckpoint(path).weight_map)


def test_deepseek_v3_mtp_and_fp8():
    names = released_names(DEEPSEEK_V3_CONFIG)
    mtp_layer = [n for n in names if n.startswith("model.layers.61.")]
    weights = [n for n in mtp_layer if not n.endswith("_scale_inv")]
    # one MoE decoder layer: 7 MLA + 2 norms + router weight and bias + 3 shared + 3 x 256 experts; plus 6 MTP tensors
    assert len(weights) == 7 + 2 + 2 + 3 + 3 * 256 + 6
    assert len(mtp_layer) - len(weights) == 5 + 3 + 3 * 256              # fp8 scales of its linears
    assert "model.layers.61.eh_proj.weight" in names and "model.layers.62.enorm.weight" not in names
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in names
    assert "model.layers.5.mlp.gate.weight_scale_inv" not in names and "lm_head.weight_scale_inv" not in names
    m = map_released(DEEPSEEK_V3_CONFIG, tp=8, pp=1, ep=32)
    assert m.mtp_skipped == len(mtp_layer)
    assert m.mapped + m.scales + m.mtp_skipped == len(names)
    assert m.scales == sum(n.endswith("_scale_inv") for n in names) - (len(mtp_layer) - len(weights))


@pytest.mark.parametrize("cfg,pp,ep", [(KIMI_K2_CONFIG, 1, 64), (MOONLIGHT_CONFIG, 1, 8)])
def test_released_layouts_map(cfg, pp, ep):
    m = map_released(cfg, pp=pp, ep=ep)
    L, dense, E = cfg["num_hidden_layers"], cfg["first_k_dense_replace"], cfg["n_routed_experts"]
    linears = L * (5 if cfg["q_lora_rank"] else 4) + dense * 3 + (L - dense) * (3 + 3 * E)
    fp8 = (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
    assert (m.mtp_skipped, m.scales) == (0, linears if fp8 else 0)
    # embeddings, final norm, lm_head; per layer two norms and the latent norms; per MoE layer the router and its bias
    norms_router = 3 + L * (2 + (2 if cfg["q_lora_rank"] else 1)) + (L - dense) * 2
    assert m.mapped == linears + norms_router


def test_refusals():
    with pytest.raises(ValueError, match="not divisible by expert parallel size 7"):
        map_released(MOONLIGHT_CONFIG, ep=7)
    with pytest.raises(ValueError, match="num_layers=27 is not divisible by pipeline parallel size 2"):
        map_released(MOONLIGHT_CONFIG, pp=2)
