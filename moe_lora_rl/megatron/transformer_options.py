"""verl's `actor_rollout_ref.actor.megatron.override_transformer_config` -> validated TransformerConfig kwargs (pure).

    kw = transformer_options(recompute_keys)         # ValueError naming the key
    build_model(..., transformer_overrides=kw)       # -> transformer_config_kwargs(**kw)
    check_for_model(kw, arch, layout)                # build_model: what the options ask of this model and layout

The recompute part of verl's override_transformer_config: megatron/moe_options.transformer_overrides (the one entry
for the whole section: MoE options there) hands its recompute keys here. Every key is in one of the tables below:
HONOURED (passed to megatron-core 0.16.1's TransformerConfig), ACCEPTED (taken and not passed, with the reason), or
refused as unknown. Activation recompute is the one memory option that matters for LoRA RL: the frozen
base's activations are most of a training step's memory, and recomputing them in backward leaves the adapters'
gradients exact (the router replays the same routes in the recompute: router_replay/replayer.py).
"""
from __future__ import annotations

from typing import Mapping

KEY = "override_transformer_config"       # verl's actor_rollout_ref.actor.megatron.<KEY>

GRANULARITIES = (None, "full", "selective")
METHODS = ("uniform", "block")

# selective recompute on our specs (megatron-core 0.16.1): module -> what megatron-core checkpoints there
SELECTIVE_MODULES = {
    "core_attn": "the core attention (tensor_parallel.checkpoint around DotProductAttention)",
    "layernorm": "input_layernorm and pre_mlp_layernorm (CheckpointWithoutOutput: outputs freed, rebuilt in backward)",
    "mlp": "the dense MLP of the model's dense layers",
    "moe": "the whole MoE layer, router included (the router replays the same routes in the recompute)",
    "shared_experts": "the shared experts of each MoE layer",
}
REFUSED_MODULES = {
    "moe_act": "megatron-core 0.16.1 recomputes the expert activation only for grouped-GEMM experts; the local "
               "spec's SequentialMLP has none: use 'moe' (the whole MoE layer)",
    "mla_up_proj": "not checked on this engine's MLA path: use 'core_attn', 'layernorm' or 'moe'",
}

HONOURED = {
    "recompute_granularity": "None (keep every activation), 'full' (whole layers, recompute_method / "
                             "recompute_num_layers), 'selective' (recompute_modules)",
    "recompute_method": "'uniform' (every layer, in chunks of recompute_num_layers) or 'block' (the first "
                        "recompute_num_layers layers of each pipeline stage); full granularity only",
    "recompute_num_layers": "an int from 1 to the layers per pipeline stage; full granularity only",
    "recompute_modules": f"selective granularity: a subset of {tuple(SELECTIVE_MODULES)} (ignored when "
                         "recompute_granularity is None, as megatron-core does: verl's default is ['core_attn'])",
}
ACCEPTED = {
    "attention_backend": "taken, not passed: the local spec's DotProductAttention is one unfused implementation "
                         "whatever the backend; on the TE spec megatron-core's default (auto) lets Transformer "
                         "Engine choose flash or fused attention",
}
def transformer_options(override: Mapping | None) -> dict:
    """TransformerConfig kwargs from verl's override_transformer_config (a dict or DictConfig; None or {}: none).

    Returns only what changes megatron-core's behaviour: {} without recompute; with it recompute_granularity and
    its method / num_layers (full) or modules (selective). Raises ValueError (one line naming
    `actor_rollout_ref.actor.megatron.override_transformer_config.<key>` and what to do) on any key outside
    HONOURED / ACCEPTED and any inconsistent recompute setting."""
    o = dict(override or {})
    for key in o:
        if key not in HONOURED and key not in ACCEPTED:
            raise ValueError(f"{KEY}.{key} is not supported by the moe_lora engine (supported: "
                             f"{', '.join(sorted([*HONOURED, *ACCEPTED]))}); remove it")
    gran, method, num = o.get("recompute_granularity"), o.get("recompute_method"), o.get("recompute_num_layers")
    modules = o.get("recompute_modules")
    if gran not in GRANULARITIES:
        raise ValueError(f"{KEY}.recompute_granularity={gran!r}: choose one of {GRANULARITIES}")
    if gran is None:
        for k, v in (("recompute_method", method), ("recompute_num_layers", num)):
            if v is not None:
                raise ValueError(f"{KEY}.{k}={v!r} without recompute_granularity recomputes nothing; set "
                                 f"{KEY}.recompute_granularity=full or remove {k}")
        return {}
    if gran == "full":
        if method not in METHODS:
            raise ValueError(f"{KEY}.recompute_method={method!r} with recompute_granularity=full: choose one of "
                             f"{METHODS}")
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise ValueError(f"{KEY}.recompute_num_layers={num!r} with recompute_granularity=full: give an int >= 1 "
                             "(layers per recompute chunk for uniform, recomputed layers per stage for block)")
        return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": num}
    for k, v in (("recompute_method", method), ("recompute_num_layers", num)):
        if v is not None:
            raise ValueError(f"{KEY}.{k}={v!r} with recompute_granularity=selective: megatron-core takes it only "
                             "with full granularity; remove it (selective recompute is chosen by recompute_modules)")
    modules = ["core_attn"] if modules is None else list(modules)
    if not modules:
        raise ValueError(f"{KEY}.recompute_modules=[] with recompute_granularity=selective recomputes nothing; "
                         f"choose from {tuple(SELECTIVE_MODULES)}")
    for m in modules:
        if m in REFUSED_MODULES:
            raise ValueError(f"{KEY}.recompute_modules contains {m!r}: {REFUSED_MODULES[m]}")
        if m not in SELECTIVE_MODULES:
            raise ValueError(f"{KEY}.recompute_modules contains {m!r}: choose from {tuple(SELECTIVE_MODULES)}")
    return {"recompute_granularity": "selective", "recompute_modules": list(dict.fromkeys(modules))}


def check_for_model(kw: Mapping, arch, layout) -> None:
    """What transformer_options' result asks of this model (models.arch.MoEArch) and layout (megatron.layout.Layout):
    ValueError where megatron-core would recompute nothing or index past the stage's layers."""
    if kw.get("recompute_granularity") == "full":
        per_stage = arch.num_layers // layout.pp
        if kw["recompute_num_layers"] > per_stage:
            raise ValueError(f"{KEY}.recompute_num_layers={kw['recompute_num_layers']} exceeds the {per_stage} layers "
                             f"per pipeline stage (num_layers={arch.num_layers}, pp={layout.pp}); give 1..{per_stage}")
        if kw["recompute_method"] == "uniform" and per_stage % kw["recompute_num_layers"]:
            raise ValueError(f"{KEY}.recompute_num_layers={kw['recompute_num_layers']} with recompute_method=uniform "
                             f"does not divide the {per_stage} layers per pipeline stage; give a divisor")
    modules = kw.get("recompute_modules") or []
    if kw.get("recompute_granularity") == "selective":
        if "mlp" in modules and all(arch.moe_layers):
            raise ValueError(f"{KEY}.recompute_modules contains 'mlp' but every layer of this model is MoE (no dense "
                             "MLP to recompute); use 'moe'")
        if "shared_experts" in modules and not arch.shared_expert_ffn:
            raise ValueError(f"{KEY}.recompute_modules contains 'shared_experts' but this model has no shared "
                             "experts; remove it")
