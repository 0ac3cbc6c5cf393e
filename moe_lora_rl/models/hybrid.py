"""The architecture reader of the hybrid linear-attention MoE family (pure): Qwen3.5/3.6-MoE and Qwen3-Next.

    Qwen3_5MoeForCausalLM               the text model, tensors model.layers.L.*
    Qwen3_5MoeForConditionalGeneration  as released (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B, Qwen3.6-35B-A3B): the
                                        text tower's config nested as text_config, its tensors model.language_model.*,
                                        a vision tower model.visual.* (left out: text_tower), MTP layers mtp.*
    Qwen3NextForCausalLM                the sibling: the delta-net's input projections fused per key head
                                        (in_proj_qkvz, in_proj_ba: fused_linear_proj), dense layers by
                                        mlp_only_layers / decoder_sparse_step

Layers follow `layer_types`: "linear_attention" (a Gated DeltaNet: in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, a
depthwise causal conv over q|k|v, A_log, dt_bias, a gated RMSNorm, out_proj) and "full_attention" (gated attention:
q_proj emits the query and a sigmoid output gate, q/k norms, partial rotary). Every MoE layer has a softmax top-k router
renormalised over the top k, routed experts and a shared expert behind a sigmoid gate. The RMSNorms of the layers, the
final norm and q/k compute x * (1 + w) (zero_centered_norms); the delta-net's gated norm computes x * w.

The VL config's rotary (mrope_section / mrope_interleaved) rotates text positions by (t, h, w) all equal to the
token's position, which is 1-D RoPE: the text tower is read with plain partial RoPE, and only text is trained.
The MTP layers (mtp_num_hidden_layers, tensors mtp.*) are left out on purpose: RL trains and serves the backbone
(models.checkpoint.HFCheckpoint sets them aside, counted). Every refusal is a ValueError naming the value.
"""
from __future__ import annotations

from typing import Any

from .hf_config import common
from .hf_config import get_field as _get

LAYER_TYPES = ("linear_attention", "full_attention")


def text_config(cfg: Any) -> Any:
    """The text model's config: text_config of a *ForConditionalGeneration config (object or dict), else cfg."""
    text = _get(cfg, "text_config")
    return cfg if text is None else text


def hybrid_fields(cfg: Any) -> dict:
    """models.arch.MoEArch's fields of a hybrid config (see the module docstring)."""
    archs = _get(cfg, "architectures") or []
    next_ = "Qwen3NextForCausalLM" in archs
    family = "qwen3_next" if next_ else "qwen3_5_moe"
    tower = _get(cfg, "text_config") is not None
    t = text_config(cfg)
    n = _get(t, "num_hidden_layers")
    types = tuple(_get(t, "layer_types") or ())
    if len(types) != n or any(x not in LAYER_TYPES for x in types):
        raise ValueError(f"{family} layer_types={list(types)}: need {n} entries, each one of {LAYER_TYPES}")
    kh, vh = _get(t, "linear_num_key_heads"), _get(t, "linear_num_value_heads")
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim"):
        if not isinstance(_get(t, key), int) or _get(t, key) < 1:
            raise ValueError(f"{family} {key}={_get(t, key)!r}: must be a positive integer")
    if vh % kh:
        raise ValueError(f"{family} linear_num_value_heads={vh} is not a multiple of linear_num_key_heads={kh}")
    if _get(t, "hidden_act", "silu") != "silu":
        raise ValueError(f"{family} hidden_act={_get(t, 'hidden_act')!r}: the delta-net and experts use silu; "
                         "accepted: 'silu'")
    if _get(t, "attention_bias", False):
        raise ValueError(f"{family} attention_bias=True: the released models have none and the gated q_proj's bias "
                         "layout is not mapped; accepted: False")
    if not _get(t, "norm_topk_prob", True):
        raise ValueError(f"{family} norm_topk_prob=False: accepted: True (Qwen3.5 always renormalises the top k)")
    dense = set(_get(t, "mlp_only_layers") or [])
    step = _get(t, "decoder_sparse_step", 1) or 1
    moe = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    mtp = _get(t, "mtp_num_hidden_layers", None)
    mtp = _get(t, "num_nextn_predict_layers", 0) if mtp is None else mtp
    base = common(t, family)
    return dict(base, qkv_bias=False, qk_norm=True, num_experts=_get(t, "num_experts"),
                moe_layers=moe, score_function="softmax", pre_softmax=False, expert_bias=False, num_groups=None,
                group_topk=None, scaling_factor=None, shared_expert_ffn=_get(t, "shared_expert_intermediate_size"),
                layer_types=types, linear_num_key_heads=kh, linear_num_value_heads=vh,
                linear_key_head_dim=_get(t, "linear_key_head_dim"),
                linear_value_head_dim=_get(t, "linear_value_head_dim"),
                linear_conv_kernel=_get(t, "linear_conv_kernel_dim"), fused_linear_proj=next_,
                attention_output_gate=True, shared_expert_gate=True, zero_centered_norms=True, text_tower=tower,
                mtp_layers=int(mtp or 0), mtp_prefix=True,
                tie_embeddings=bool(_get(cfg, "tie_word_embeddings", base["tie_embeddings"])))
