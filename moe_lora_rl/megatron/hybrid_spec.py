"""The hybrid linear-attention family (models/hybrid.py: Qwen3.5/3.6-MoE, Qwen3-Next) in megatron-core 0.16.1 terms.

    kw = hybrid_kwargs(arch)              # TransformerConfig fields: gated delta-net variant, per-layer pattern, gates
    spec = block_spec(cfg, rc)            # this pipeline stage's decoder block spec

Linear layers are megatron-core's own `ssm.gated_delta_net.GatedDeltaNet`, full layers SelfAttention with
attention_output_gate (the query and its sigmoid gate from one projection), every MoE layer's shared expert behind
its sigmoid gate (moe_shared_expert_gate). On the TE spec (GPU) megatron-core's
get_transformer_block_with_experimental_attention_variant_spec builds the block (input norms fused into in_proj /
linear_qkv). That function is Transformer-Engine-only, so on the local spec (CPU) the same block is built here from the
local pieces: the local GPT layer per layer (MoE or dense by moe_layer_freq), with the linear layers' self_attention
replaced by a GatedDeltaNet of ColumnParallelLinear in_proj, local RMSNorm out_norm (build.py swaps in SPRMSNorm)
and RowParallelLinear out_proj, input_layernorm kept a real norm (fuse_input_layernorm False). On CPU without
flash-linear-attention the delta rule runs on cpu_support's torch binding (patches/README.md).

HF's layer, final and q/k RMSNorms compute x * (1 + w); megatron's local RMSNorm x * w: layernorm_zero_centered_gamma
stays off and the loader adds one to those weights (shard kind plus_one, megatron/hf_load_hybrid.py).
"""
from __future__ import annotations

import dataclasses

from ..models.arch import MoEArch
from .run_config import RunConfig


def linear_pattern(arch: MoEArch) -> list[int]:
    """megatron-core's linear_attention_freq as a per-layer list: 1 = Gated DeltaNet, 0 = full attention."""
    return [int(t == "linear_attention") for t in arch.layer_types]


def hybrid_kwargs(arch: MoEArch) -> dict:
    """TransformerConfig fields of a hybrid architecture (pure)."""
    return dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=linear_pattern(arch),
                linear_conv_kernel_dim=arch.linear_conv_kernel, linear_key_head_dim=arch.linear_key_head_dim,
                linear_value_head_dim=arch.linear_value_head_dim, linear_num_key_heads=arch.linear_num_key_heads,
                linear_num_value_heads=arch.linear_num_value_heads,
                attention_output_gate=arch.attention_output_gate, moe_shared_expert_gate=arch.shared_expert_gate,
                layernorm_zero_centered_gamma=False)


def gated_delta_net_local_spec():
    """GatedDeltaNet from the local spec's pieces, with a separate input norm (the layer's input_layernorm)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    local = LocalSpecProvider()
    return ModuleSpec(module=GatedDeltaNet,
                      submodules=GatedDeltaNetSubmodules(in_proj=local.column_parallel_linear(),
                                                         out_norm=local.layer_norm(rms_norm=True, for_qk=False),
                                                         out_proj=local.row_parallel_linear()),
                      metainfo={"fuse_input_layernorm": False})


def block_spec(cfg, rc: RunConfig):
    """The decoder block spec of this pipeline stage for a hybrid TransformerConfig."""
    if rc.layer_spec == "te":
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec)

        return get_transformer_block_with_experimental_attention_variant_spec(cfg)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if cfg.pipeline_model_parallel_layout is not None:
        raise ValueError("hybrid model with pipeline_model_parallel_layout: not supported on the local spec; "
                         "leave it unset (even stages)")
    gdn = gated_delta_net_local_spec()
    layers = []
    for spec, linear in zip(get_gpt_decoder_layer_specs(cfg, use_transformer_engine=False, normalization="RMSNorm"),
                            get_linear_attention_pattern(cfg)):
        if linear:
            # the TE spec's name of this norm (fused into in_proj), for megatron's distributed checkpoint
            keys = {**spec.submodules.sharded_state_dict_keys_map,
                    "input_layernorm.": "self_attention.in_proj.layer_norm_"}
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(
                spec.submodules, self_attention=gdn, sharded_state_dict_keys_map=keys))
        layers.append(spec)
    offset = get_transformer_layer_offset(cfg)
    layers = layers[offset: offset + get_num_layers_to_build(cfg)]
    return TransformerBlockSubmodules(layer_specs=layers,
                                      layer_norm=LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False))
