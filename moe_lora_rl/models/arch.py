"""A model family's HF config, reduced to the architecture facts the Megatron builder needs (pure, no torch).

One reader per HF architecture, chosen from a table; an unknown architecture or an option Megatron-core cannot
reproduce exactly is a ValueError naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class MoEArch:
    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int                 # dense MLP layers
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_percent: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    num_experts: int
    topk: int
    moe_ffn_hidden_size: int
    moe_layers: tuple[bool, ...]         # per global layer: True = MoE
    score_function: str                  # "softmax" | "sigmoid"
    pre_softmax: bool                    # softmax over all experts before top-k (no top-k renormalisation)
    expert_bias: bool
    num_groups: int | None
    group_topk: int | None
    scaling_factor: float | None
    shared_expert_ffn: int               # 0 = no shared expert

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]

    def adaptable(self) -> set[str]:
        """The LoRA targets (the family naming's linears) this model has a linear for."""
        from .naming import naming_for

        moe = any(self.moe_layers)
        present = {"attention": True, "dense": not all(self.moe_layers), "expert": moe,
                   "shared": moe and bool(self.shared_expert_ffn)}
        return {li.target for li in naming_for(self).linears if present[li.part]}


def _get(cfg: Any, name: str, default=None):
    return getattr(cfg, name, default) if not isinstance(cfg, dict) else cfg.get(name, default)


def _rope(cfg: Any) -> tuple[float, float]:
    rp = _get(cfg, "rope_parameters") or {}
    rope_type = rp.get("rope_type", (_get(cfg, "rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported by the Megatron builder; only 'default' RoPE is")
    theta = rp.get("rope_theta", _get(cfg, "rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def _common(cfg: Any, family: str) -> dict:
    theta, partial = _rope(cfg)
    heads = _get(cfg, "num_attention_heads")
    return dict(
        family=family, vocab_size=_get(cfg, "vocab_size"), hidden_size=_get(cfg, "hidden_size"),
        ffn_hidden_size=_get(cfg, "intermediate_size"), num_layers=_get(cfg, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=_get(cfg, "num_key_value_heads", heads),
        head_dim=_get(cfg, "head_dim") or _get(cfg, "hidden_size") // heads,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps")), rope_theta=theta, rotary_percent=partial,
        tie_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        moe_ffn_hidden_size=_get(cfg, "moe_intermediate_size"), topk=_get(cfg, "num_experts_per_tok"),
    )


def _qwen3_moe(cfg: Any) -> MoEArch:
    n = _get(cfg, "num_hidden_layers")
    step = _get(cfg, "decoder_sparse_step", 1)
    dense = set(_get(cfg, "mlp_only_layers") or [])
    if _get(cfg, "use_sliding_window", False):
        raise ValueError("qwen3_moe with use_sliding_window=True is not supported by the Megatron builder")
    moe = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    norm = bool(_get(cfg, "norm_topk_prob", False))
    return MoEArch(**_common(cfg, "qwen3_moe"), qkv_bias=bool(_get(cfg, "attention_bias", False)), qk_norm=True,
                   num_experts=_get(cfg, "num_experts"), moe_layers=moe, score_function="softmax",
                   pre_softmax=not norm, expert_bias=False, num_groups=None, group_topk=None, scaling_factor=None,
                   shared_expert_ffn=0)


def _glm4_moe(cfg: Any) -> MoEArch:
    n = _get(cfg, "num_hidden_layers")
    first_dense = _get(cfg, "first_k_dense_replace", 0)
    topk, n_group, topk_group = _get(cfg, "num_experts_per_tok"), _get(cfg, "n_group", 1), _get(cfg, "topk_group", 1)
    if not _get(cfg, "norm_topk_prob", True):
        raise ValueError("glm4_moe with norm_topk_prob=False: megatron-core always renormalises sigmoid top-k "
                         "scores, so this routing cannot be reproduced")
    grouped = n_group and n_group > 1
    if grouped and topk // topk_group != 2:
        raise ValueError(f"glm4_moe n_group={n_group}, topk_group={topk_group}, num_experts_per_tok={topk}: HF scores "
                         "a group by its top-2 experts, megatron-core by its top (topk // topk_group); they agree only "
                         "when num_experts_per_tok == 2 * topk_group")
    shared = _get(cfg, "n_shared_experts", 0) or 0
    scale = float(_get(cfg, "routed_scaling_factor", 1.0))
    return MoEArch(**_common(cfg, "glm4_moe"), qkv_bias=bool(_get(cfg, "attention_bias", False)),
                   qk_norm=bool(_get(cfg, "use_qk_norm", False)), num_experts=_get(cfg, "n_routed_experts"),
                   moe_layers=tuple(i >= first_dense for i in range(n)), score_function="sigmoid", pre_softmax=False,
                   expert_bias=True, num_groups=n_group if grouped else None,
                   group_topk=topk_group if grouped else None, scaling_factor=scale if scale != 1.0 else None,
                   shared_expert_ffn=shared * _get(cfg, "moe_intermediate_size"))


READERS: dict[str, Callable[[Any], MoEArch]] = {
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Glm4MoeForCausalLM": _glm4_moe,
}


def arch_from_hf_config(cfg: Any) -> MoEArch:
    archs = _get(cfg, "architectures") or []
    for a in archs:
        if a in READERS:
            return READERS[a](cfg)
    raise ValueError(f"HF architectures={archs} not supported by the Megatron builder; supported: {sorted(READERS)}")


def load_arch(path) -> MoEArch:
    """The architecture of the HF checkpoint directory PATH (reads its config.json through transformers)."""
    import transformers

    return arch_from_hf_config(transformers.AutoConfig.from_pretrained(str(path)))
