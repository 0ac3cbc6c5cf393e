"""A model family's HF config, reduced to the architecture facts the Megatron builder needs (pure, no torch).

One reader per HF architecture, chosen from a table; an unknown architecture or an option Megatron-core cannot
reproduce exactly is a ValueError naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from .hf_config import common as _common
from .hf_config import get_field as _get


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
    # Multi-head Latent Attention (DeepseekV3ForCausalLM); kv_lora_rank None = GQA attention
    q_lora_rank: int | None = None       # None with MLA: q is one projection (q_proj), as Moonlight
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_type: str = "default"           # "default" | "yarn"
    yarn: tuple[tuple[str, float], ...] = ()   # yarn: factor, original_max_position_embeddings, beta_fast, beta_slow,
                                               # mscale, mscale_all_dim (HF's rope_parameters names)
    mtp_layers: int = 0                  # num_nextn_predict_layers: model.layers.{num_layers + i}.*, never built
    # hybrid linear attention (Qwen3.5/3.6-MoE, Qwen3-Next: hybrid.py); () = every layer full attention
    layer_types: tuple[str, ...] = ()    # per global layer: "linear_attention" (Gated DeltaNet) | "full_attention"
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0      # a multiple of the key heads (each key head serves value/key of them)
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0          # the depthwise causal conv's width
    fused_linear_proj: bool = False      # Qwen3-Next: in_proj_qkvz / in_proj_ba, interleaved per key head
    attention_output_gate: bool = False  # q_proj emits query and a sigmoid output gate (per head: [q, gate])
    shared_expert_gate: bool = False     # shared expert output scaled by sigmoid(shared_expert_gate(x))
    zero_centered_norms: bool = False    # HF RMSNorm computes x * (1 + w) (not the delta-net's gated norm)
    text_tower: bool = False             # a *ForConditionalGeneration checkpoint: the text tower is read, the
                                         # vision tower (model.visual.*) left out
    mtp_prefix: bool = False             # MTP tensors stored as mtp.* (Qwen3.5 / Qwen3-Next), not model.layers.N

    @property
    def hybrid(self) -> bool:
        return bool(self.layer_types)

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def mtp_layer_ids(self) -> list[int]:
        """HF layer numbers of the MTP layers (tensors model.layers.{i}.*), which no builder maps (none when the
        checkpoint stores them under mtp.*: mtp_prefix)."""
        return [] if self.mtp_prefix else list(range(self.num_layers, self.num_layers + self.mtp_layers))

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]

    def adaptable(self) -> set[str]:
        """The LoRA targets (the family naming's linears) this model has a linear for."""
        from .naming import naming_for

        moe = any(self.moe_layers)
        linear = bool(self.linear_layer_ids)
        present = {"attention": not self.hybrid or len(self.linear_layer_ids) < self.num_layers,
                   "linear_attention": linear, "dense": not all(self.moe_layers), "expert": moe,
                   "shared": moe and bool(self.shared_expert_ffn)}
        return {li.target for li in naming_for(self).linears if present[li.part]}


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


def _glm4_moe(cfg: Any, family: str = "glm4_moe") -> MoEArch:
    n = _get(cfg, "num_hidden_layers")
    first_dense = _get(cfg, "first_k_dense_replace", 0)
    topk, n_group, topk_group = _get(cfg, "num_experts_per_tok"), _get(cfg, "n_group", 1), _get(cfg, "topk_group", 1)
    if not _get(cfg, "norm_topk_prob", True):
        raise ValueError(f"{family} with norm_topk_prob=False: megatron-core always renormalises sigmoid top-k "
                         "scores, so this routing cannot be reproduced")
    grouped = n_group and n_group > 1
    if grouped and topk // topk_group != 2:
        raise ValueError(f"{family} n_group={n_group}, topk_group={topk_group}, num_experts_per_tok={topk}: HF scores "
                         "a group by its top-2 experts, megatron-core by its top (topk // topk_group); they agree only "
                         "when num_experts_per_tok == 2 * topk_group")
    shared = _get(cfg, "n_shared_experts", 0) or 0
    scale = float(_get(cfg, "routed_scaling_factor", 1.0))
    return MoEArch(**_common(cfg, family), qkv_bias=bool(_get(cfg, "attention_bias", False)),
                   qk_norm=bool(_get(cfg, "use_qk_norm", False)), num_experts=_get(cfg, "n_routed_experts"),
                   moe_layers=tuple(i >= first_dense for i in range(n)), score_function="sigmoid", pre_softmax=False,
                   expert_bias=True, num_groups=n_group if grouped else None,
                   group_topk=topk_group if grouped else None, scaling_factor=scale if scale != 1.0 else None,
                   shared_expert_ffn=shared * _get(cfg, "moe_intermediate_size"))


_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def _mla_rope(cfg: Any) -> tuple[str, float, tuple[tuple[str, float], ...]]:
    """(rope_type, theta, yarn parameters) of an MLA config, refusing what megatron-core's MLA rotary cannot
    reproduce exactly (it implements 'default' RoPE and DeepSeek's yarn with HF's defaults)."""
    rp = dict(_get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    theta = float(rp.get("rope_theta", _get(cfg, "rope_theta", 10000.0)))
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"deepseek_v3 partial_rotary_factor={rp['partial_rotary_factor']}: MLA rotates the whole "
                         "qk_rope_head_dim; only 1.0 is supported")
    if rope_type == "default":
        return "default", theta, ()
    if rope_type != "yarn":
        raise ValueError(f"deepseek_v3 rope_type={rope_type!r} is not supported by the Megatron builder; "
                         "accepted: 'default', 'yarn'")
    for key in ("attention_factor", "truncate"):
        if rp.get(key, None if key == "attention_factor" else True) not in (None, True):
            raise ValueError(f"deepseek_v3 yarn {key}={rp[key]!r}: megatron-core's yarn has no such option; "
                             "accepted: unset")
    orig = rp.get("original_max_position_embeddings")
    if not orig:
        raise ValueError("deepseek_v3 yarn without original_max_position_embeddings: megatron-core needs it")
    factor = rp.get("factor") or _get(cfg, "max_position_embeddings") / orig
    y = {k: float(rp.get(k) or v) for k, v in _YARN_DEFAULTS.items()}
    if not rp.get("mscale_all_dim") and y["mscale"] != 1.0:
        raise ValueError(f"deepseek_v3 yarn mscale={y['mscale']} without mscale_all_dim: HF then ignores mscale and "
                         "megatron-core does not; accepted: mscale 1.0, or mscale_all_dim set")
    return "yarn", theta, (("factor", float(factor)), ("original_max_position_embeddings", float(orig)),
                           *sorted(y.items()))


def _deepseek_v3(cfg: Any) -> MoEArch:
    """DeepSeek-V3 / Kimi-K2 / Moonlight: MLA attention on glm4_moe's routing (sigmoid + bias, grouped top-k)."""
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        got = _get(cfg, key)
        if got not in (None, want):
            raise ValueError(f"deepseek_v3 {key}={got!r}: only {want!r} (DeepSeek-V3's routing) is supported")
    if not _get(cfg, "rope_interleave", True):
        raise ValueError("deepseek_v3 rope_interleave=False: megatron-core's MLA rotary de-interleaves the rope part "
                         "as DeepSeek-V3's weights need; accepted: rope_interleave=True")
    if _get(cfg, "attention_bias", False):
        raise ValueError("deepseek_v3 attention_bias=True: megatron-core's MLA linears have no bias; accepted: False")
    kv_rank, rope_dim = _get(cfg, "kv_lora_rank"), _get(cfg, "qk_rope_head_dim")
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if not isinstance(_get(cfg, key), int) or _get(cfg, key) < 1:
            raise ValueError(f"deepseek_v3 {key}={_get(cfg, key)!r}: must be a positive integer")
    q_rank = _get(cfg, "q_lora_rank")
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank < 1):
        raise ValueError(f"deepseek_v3 q_lora_rank={q_rank!r}: must be a positive integer or null")
    rope_type, theta, yarn = _mla_rope(cfg)
    base = _glm4_moe({**_as_dict(cfg), "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                      "rope_scaling": None, "head_dim": _get(cfg, "v_head_dim"), "attention_bias": False}, "deepseek_v3")
    mtp = _get(cfg, "num_nextn_predict_layers", None)
    mtp = _get(cfg, "num_mtp_layers", 0) if mtp is None else mtp
    return replace(base, num_kv_heads=base.num_heads, qk_norm=True, q_lora_rank=q_rank,
                   kv_lora_rank=kv_rank, qk_nope_head_dim=_get(cfg, "qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
                   v_head_dim=_get(cfg, "v_head_dim"), rope_type=rope_type, yarn=yarn, mtp_layers=int(mtp or 0))


def _as_dict(cfg: Any) -> dict:
    return dict(cfg) if isinstance(cfg, dict) else cfg.to_dict()


def _hybrid(cfg: Any) -> MoEArch:
    from .hybrid import hybrid_fields

    return MoEArch(**hybrid_fields(cfg))


READERS: dict[str, Callable[[Any], MoEArch]] = {
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Glm4MoeForCausalLM": _glm4_moe,
    "DeepseekV3ForCausalLM": _deepseek_v3,
    "Qwen3_5MoeForCausalLM": _hybrid,
    "Qwen3_5MoeForConditionalGeneration": _hybrid,
    "Qwen3NextForCausalLM": _hybrid,
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
