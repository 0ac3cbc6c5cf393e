"""The tensor names of a released DeepseekV3ForCausalLM checkpoint (DeepSeek-V3, Kimi-K2, Moonlight), derived from its
config.json alone, and their mapping onto a layout's Megatron parameters (pure: no weights, no torch).

    names = released_names(cfg)                  # per-expert names, MTP layers, fp8 weight_scale_inv
    report = map_released(cfg, layout)           # every name mapped, scales paired, MTP skipped and counted

The released layout: per layer the MLA tensors (q_a_proj / q_a_layernorm / q_b_proj, or q_proj with q_lora_rank
null; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), norms, and either a dense MLP (first_k_dense_replace
layers) or a router (gate.weight, gate.e_score_correction_bias), shared experts and per-expert
mlp.experts.{E}.gate/up/down_proj; with an fp8 quantization_config every linear weight of a layer carries a
`weight_scale_inv` (embeddings, lm_head, norms and the router do not); num_nextn_predict_layers MTP layers follow
as model.layers.{num_hidden_layers + i}.* (a decoder layer plus enorm, hnorm, eh_proj, shared_head, embed_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

from .naming import deepseek_v3
from .naming.offsets import Offsets, owner, split_mtp

MTP_EXTRA = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
              "embed_tokens.weight")
_NOT_QUANTISED = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "eh_proj.weight",
                  "shared_head.head.weight")


def _layer_names(naming, layer: int, moe: bool, experts: int) -> list[str]:
    out: list[str] = []
    for row in naming.params:
        if row.kind.startswith("grouped_") or row.megatron.endswith("layer_norm_weight"):
            continue                                        # legacy GroupedMLP / TE-spec spellings of the same tensors
        if "{l}" not in row.megatron:
            continue
        is_moe_row = any(k in row.megatron for k in ("mlp.router", "mlp.experts", "mlp.shared_experts"))
        if "mlp." in row.megatron and is_moe_row != moe:
            continue
        for e in (range(experts) if row.expert else [None]):
            for h in row.hf:
                name = h.replace("{L}", str(layer)).replace("{E}", str(e))
                if name not in out:
                    out.append(name)
    return out


def released_names(cfg: dict) -> list[str]:
    """Every tensor name of the released checkpoint of a DeepseekV3 config.json dict (see the module docstring)."""
    L, first_dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0) or 0
    experts, mtp = cfg["n_routed_experts"], cfg.get("num_nextn_predict_layers", 0) or 0
    naming = deepseek_v3.naming(cfg.get("q_lora_rank"))
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for layer in range(L + mtp):
        names += _layer_names(naming, layer, layer >= first_dense, experts)
        if layer >= L:
            names += [f"model.layers.{layer}.{n}" for n in MTP_EXTRA]
    if (cfg.get("quantization_config") or {}).get("quant_method") == "fp8":
        names += [n + "_scale_inv" for n in names
                  if n.endswith(".weight") and "proj" in n.split(".")[-2] and not n.endswith(_NOT_QUANTISED)]
    return names


@dataclass(frozen=True)
class MappedLayout:
    mapped: int                   # tensors mapped onto a Megatron parameter of their owning rank
    scales: int                   # fp8 weight_scale_inv tensors, each paired with a mapped weight
    mtp_skipped: int              # MTP layer tensors: skipped by name, never mapped


def map_released(cfg: dict, tp: int = 1, pp: int = 1, ep: int = 1) -> MappedLayout:
    """Map every released tensor name onto the Megatron parameter of the rank that owns it (global layer -> PP
    stage, global expert -> EP rank) and back; ValueError naming the first tensor that does not map."""
    L, experts = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    naming = deepseek_v3.naming(cfg.get("q_lora_rank"))
    names = released_names(cfg)
    backbone, mtp = split_mtp(names, L)
    weights = {n for n in backbone if not n.endswith("_scale_inv")}
    mapped = scales = 0
    for n in backbone:
        if n.endswith("_scale_inv"):
            if n[: -len("_scale_inv")] not in weights:
                raise ValueError(f"fp8 scale {n!r} has no weight {n[: -len('_scale_inv')]!r} in the checkpoint")
            scales += 1
            continue
        bits = n.split(".")
        layer = int(bits[2]) if bits[1] == "layers" else 0
        expert = int(bits[5]) if ".mlp.experts." in n else None
        _, _, off = owner(layer, expert, num_layers=L, pp=pp, num_experts=experts, ep=ep)
        meg, i = naming.megatron_param(n, off if bits[1] == "layers" else Offsets())
        if naming.resolve(meg, off if bits[1] == "layers" else Offsets()).hf_names[i] != n:
            raise ValueError(f"tensor {n!r} maps to Megatron {meg!r}, which does not map back to it")
        mapped += 1
    return MappedLayout(mapped, scales, len(mtp))
