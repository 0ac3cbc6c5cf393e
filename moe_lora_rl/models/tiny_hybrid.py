"""The hybrid linear-attention family's tiny checkpoints (models/tiny.py makes them; models/hybrid.py reads them).

    qwen3_5_moe tiny     Qwen3_5MoeForCausalLM: 4 layers [linear, linear, linear, full] (Qwen3.5's 3-of-4 pattern),
                         Gated DeltaNet with 2 key / 4 value heads, gated attention (partial rotary 0.25), 8 experts
                         top-2 and a gated shared expert on every layer
    qwen3_5_moe tiny_vl  the same text tower in the released layout: Qwen3_5MoeForConditionalGeneration (config.json
                         with text_config, tensors model.language_model.*), a one-block vision tower (model.visual.*)
                         and one MTP layer (mtp.*, mtp_num_hidden_layers 1) as Qwen3.5's checkpoints carry it
    qwen3_5_moe wide     glm4_moe wide's widths and expert count (128 experts top-8) for the main job
    qwen3_next tiny      Qwen3NextForCausalLM: the delta-net's inputs fused per key head, a dense layer
                         (mlp_only_layers), an irregular pattern [linear, full, linear, linear]

transformers writes the experts per expert (mlp.experts.E.gate_proj / up_proj / down_proj) and fuses them on load.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

FAMILIES = ("qwen3_5_moe", "qwen3_next")
INIT_VERSION = 2
"""Part of these checkpoints' cache key. 2: dt_bias drawn as Mamba's (softplus(dt_bias) in [1e-3, 0.1]): version 1's
dt_bias ~ 1 made the per-token decays g = -exp(A_log) * softplus(a + dt_bias) reach -44, where the chunked delta
rule's running sums lose fp32's precision (HF's own logits moved by 5e-4 under a half-ulp input change)."""
_TEXT = dict(
    vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    attention_dropout=0.0, eos_token_id=2, pad_token_id=0, bos_token_id=None, attention_bias=False,
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64, shared_expert_intermediate_size=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=16,
               spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
HYBRID_SPECS: dict[tuple[str, str], dict] = {
    ("qwen3_5_moe", "tiny"): dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", **_TEXT),
    ("qwen3_5_moe", "wide"): dict(
        architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
        **{**_TEXT, "hidden_size": 256, "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
           "num_experts": 128, "num_experts_per_tok": 8, "shared_expert_intermediate_size": 256}),
    ("qwen3_5_moe", "tiny_vl"): dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe", tie_word_embeddings=False,
        text_config={**_TEXT, "mtp_num_hidden_layers": 1,
                     "rope_parameters": {**_TEXT["rope_parameters"], "mrope_section": [2, 1, 1],
                                         "mrope_interleaved": True}},
        vision_config=_VISION),
    ("qwen3_next", "tiny"): dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
        **{**_TEXT, "intermediate_size": 256, "mlp_only_layers": [1],
           "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]}),
}
MTP_TENSORS = ("mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
               "mtp.pre_fc_norm_hidden.weight")
"""The MTP module's own tensors in Qwen3.5's checkpoints, beside its decoder layers mtp.layers.i.*."""


def model_class(cfg):
    """The transformers auto class that writes this config's checkpoint (None: AutoModelForCausalLM)."""
    import transformers

    if getattr(cfg, "model_type", None) == "qwen3_5_moe":
        return transformers.AutoModelForImageTextToText
    return None


def finish(out: Path, cfg, seed: int, init: Callable[[str, tuple], torch.Tensor]) -> None:
    """The released layout's MTP layers (text_config.mtp_num_hidden_layers, tensors mtp.*: a full-attention decoder
    layer copied in shape from the last one, plus MTP_TENSORS), which transformers neither builds nor writes."""
    from safetensors.torch import save_file

    from .checkpoint import read_single_file

    text = getattr(cfg, "text_config", None)
    mtp = getattr(text, "mtp_num_hidden_layers", 0) if text is not None else 0
    if not mtp:
        return
    state = read_single_file(out)
    last = f"model.language_model.layers.{text.num_hidden_layers - 1}."
    h = text.hidden_size
    shapes = {"mtp.fc.weight": (h, 2 * h)}
    for i in range(mtp):
        for k in [k for k in state if k.startswith(last)]:
            name = f"mtp.layers.{i}." + k[len(last):]
            state[name] = init(name, tuple(state[k].shape)).to(state[k].dtype)
    for name in MTP_TENSORS:
        state[name] = init(name, shapes.get(name, (h,))).to(torch.float32)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((out / "config.json").read_text())
    conf["text_config"]["mtp_num_hidden_layers"] = mtp
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
