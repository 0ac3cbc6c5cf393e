"""megatron-core TransformerConfig options a user's config may set (verl's
actor_rollout_ref.actor.megatron.override_transformer_config) read into build_from_hf's keyword arguments: each one
honoured, or refused in one line before any process group or model exists.

    kw = transformer_overrides(engine_config.override_transformer_config, layout, rc)   # ValueError, one line
    arch, model = build_from_hf(path, layout, rc, lora=cfg, **kw)

Honoured (the MoE block computes the same function with the adapters' gradients intact; checked at tp1, etp2, tp2,
tp2etp2 and ep2 against the plain layout by tests/distributed/test_moe_options.py):
    moe_shared_expert_overlap     True or False (megatron-core runs the shared expert inside the all-to-all
                                  dispatcher; lora/sharding.py's rule follows its explicit TP communication)
    moe_token_dispatcher_type     "alltoall" (ours, megatron-core's default is allgather); "allgather" with ep=1 and
                                  pp=1 (its all-gather needs equal token counts on every rank of TPxEP, which
                                  variable-length micro-batches on different data-parallel ranks do not give)
    moe_grouped_gemm              True: the local spec's legacy GroupedMLP (rc.grouped_experts); the TE spec has it on
    moe_use_legacy_grouped_gemm   with moe_grouped_gemm on the local spec
    moe_permute_fusion            False
Activation recompute (recompute_granularity, recompute_method, recompute_num_layers, recompute_modules) and
attention_backend are read by megatron/transformer_options.py (recompute honoured with router replay, attention_backend
accepted) and reach build_model as `transformer_overrides`. The defaults of the options REFUSED lists are accepted.
Every other key or value is refused, naming it.
"""
from __future__ import annotations

from typing import Any, Mapping

from .layout import Layout
from .run_config import RunConfig
from .transformer_options import ACCEPTED as RECOMPUTE_ACCEPTED
from .transformer_options import HONOURED as RECOMPUTE_HONOURED
from .transformer_options import transformer_options

KEY = "override_transformer_config"
DISPATCHERS = ("alltoall", "allgather")
# read by transformer_options (activation recompute, attention_backend)
RECOMPUTE = (*RECOMPUTE_HONOURED, *RECOMPUTE_ACCEPTED)
# key: (the default, which changes nothing; why another value is refused)
REFUSED = {
    "moe_permute_fusion": (False, "Transformer Engine's fused permutation kernels (CUDA) are not checked with expert "
                                  "adapters; set it false"),
    "moe_router_fusion": (False, "the fused router bypasses router replay (R3); set it false"),
    "moe_enable_deepep": (False, "DeepEP is a CUDA flex dispatcher; use moe_token_dispatcher_type alltoall"),
    "moe_flex_dispatcher_backend": ("deepep", "the flex dispatcher is not supported; use moe_token_dispatcher_type "
                                              "alltoall"),
    "overlap_moe_expert_parallel_comm": (False, "the EP overlap schedule is not supported; leave it false"),
    "moe_expert_capacity_factor": (None, "dropping tokens at a capacity changes the model against the rollout "
                                         "engine; leave it null"),
    "moe_pad_expert_input_to_capacity": (False, "capacity padding is not supported; leave it false"),
    "moe_apply_probs_on_input": (False, "probabilities on the expert input change the model against its checkpoint; "
                                        "leave it false"),
    "moe_layer_recompute": (False, "megatron-core's legacy MoE recompute switch: use recompute_granularity=selective "
                                   "with recompute_modules=['moe'] (honoured, with router replay)"),
}


def _refuse(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{KEY}.{key}={value!r}: {why}")


def transformer_overrides(overrides: Mapping[str, Any] | None, layout: Layout, rc: RunConfig) -> dict:
    """build_from_hf's keyword arguments (TransformerConfig fields, grouped_experts) for a user's
    override_transformer_config (pure). ValueError naming the first key or value we cannot honour."""
    overrides = dict(overrides or {})
    kw: dict[str, Any] = {}
    recompute = transformer_options({k: v for k, v in overrides.items() if k in RECOMPUTE})
    if recompute:
        kw["transformer_overrides"] = recompute
    for key, value in overrides.items():
        if key in RECOMPUTE:
            continue
        if key == "moe_shared_expert_overlap":
            if value not in (True, False):
                raise _refuse(key, value, "choose true or false")
            if value and rc.layer_spec == "te":
                raise _refuse(key, value, "the TE spec's shared-expert linears then lose their parallel mode, which "
                              "the adapters' sharding rule reads; checked on the local spec only, set it false")
            kw[key] = bool(value)
        elif key == "moe_token_dispatcher_type":
            kw.update(_dispatcher(value, layout))
        elif key == "moe_grouped_gemm":
            if value not in (True, False):
                raise _refuse(key, value, "choose true or false")
            if value and rc.layer_spec == "local":
                kw["grouped_experts"] = True           # build_model sets moe_grouped_gemm and the legacy GroupedMLP
            elif not value and rc.layer_spec == "te":
                raise _refuse(key, value, "the TE spec's experts are TEGroupedMLP; leave it true")
        elif key == "moe_use_legacy_grouped_gemm":
            if value and not (rc.layer_spec == "local" and overrides.get("moe_grouped_gemm")):
                raise _refuse(key, value, "only with moe_grouped_gemm=true on the local spec (its GroupedMLP)")
        elif key in REFUSED:
            default, why = REFUSED[key]
            if value != default:
                raise _refuse(key, value, why)
        else:
            raise _refuse(key, value, "not an option moe_lora_rl honours (the model's fields come from its checkpoint, "
                          "parallel sizes from the engine config); remove it")
    if kw.get("moe_shared_expert_overlap") and kw.get("moe_token_dispatcher_type", "alltoall") != "alltoall":
        raise _refuse("moe_shared_expert_overlap", True, "megatron-core overlaps the shared expert only with "
                      "moe_token_dispatcher_type alltoall")
    return kw


def _dispatcher(value: Any, layout: Layout) -> dict:
    key = "moe_token_dispatcher_type"
    if value == "alltoall":
        return {key: value}
    if value == "allgather":
        if layout.ep > 1 or layout.pp > 1:
            raise _refuse(key, value, f"its all-gather needs equal token counts on every TPxEP rank, which "
                          f"variable-length micro-batches do not give at layout {layout.name}; use alltoall")
        return {key: value, "variable_seq_lengths": False}   # read only by the pipeline's p2p shapes (pp=1 here)
    if value in ("flex", "alltoall_seq"):
        why = "needs DeepEP / HybridEP (CUDA)" if value == "flex" else "is not in megatron-core 0.16 (alltoall is)"
        raise _refuse(key, value, f"{why}; use alltoall")
    raise _refuse(key, value, f"choose one of {DISPATCHERS}")
