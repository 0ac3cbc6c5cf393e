"""Reading HF config fields (pure): from a config object or its dict, the RoPE every GQA family shares, and the
fields every family's reader takes alike (models/arch.py's readers and models/hybrid.py use them)."""
from __future__ import annotations

from typing import Any


def get_field(cfg: Any, name: str, default=None):
    """cfg.name (or cfg[name] of a dict), default when absent."""
    return getattr(cfg, name, default) if not isinstance(cfg, dict) else cfg.get(name, default)


def _rope(cfg: Any) -> tuple[float, float]:
    rp = get_field(cfg, "rope_parameters") or {}
    rope_type = rp.get("rope_type", (get_field(cfg, "rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported by the Megatron builder; only 'default' RoPE is")
    theta = rp.get("rope_theta", get_field(cfg, "rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", get_field(cfg, "partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def common(cfg: Any, family: str) -> dict:
    """The fields every family reads alike (MoEArch keyword arguments)."""
    theta, partial = _rope(cfg)
    heads = get_field(cfg, "num_attention_heads")
    return dict(
        family=family, vocab_size=get_field(cfg, "vocab_size"), hidden_size=get_field(cfg, "hidden_size"),
        ffn_hidden_size=get_field(cfg, "intermediate_size"), num_layers=get_field(cfg, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=get_field(cfg, "num_key_value_heads", heads),
        head_dim=get_field(cfg, "head_dim") or get_field(cfg, "hidden_size") // heads,
        rms_norm_eps=float(get_field(cfg, "rms_norm_eps")), rope_theta=theta, rotary_percent=partial,
        tie_embeddings=bool(get_field(cfg, "tie_word_embeddings", False)),
        moe_ffn_hidden_size=get_field(cfg, "moe_intermediate_size"), topk=get_field(cfg, "num_experts_per_tok"),
    )
