"""Build a megatron-core GPTModel with MoE from an HF config, for the current rank of a layout.

    arch = arch_from_hf_config(hf_config)          # pure: family reader, ValueError on what cannot be reproduced
    model = build_model(arch, layout, rc)          # rc: RunConfig (device, dtype, layer spec); default fp32 on CPU

The local spec (SequentialMLP experts) gets SP-tolerant RMSNorms; the Transformer Engine spec (TEGroupedMLP) is taken
as megatron-core builds it. Multi-head Latent Attention (arch.mla: DeepSeek-V3, Kimi-K2, Moonlight) is megatron-core's
MLASelfAttention from an MLATransformerConfig: on CPU with the local spec (plus cpu_support's MLA core attention, which
takes MLA's k_channels / v_channels), on GPU with the TE spec (get_gpt_decoder_block_spec(use_transformer_engine=True)
with multi_latent_attention and qk_layernorm from the config: TELinear down projections, TELayerNormColumnParallelLinear
up projections carrying the latent norms). The hybrid linear-attention family (arch.hybrid: Qwen3.5/3.6-MoE,
Qwen3-Next) is megatron-core's GatedDeltaNet and gated attention, its block spec from hybrid_spec.py.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch
import torch.nn.functional as F

from ..models.arch import MoEArch
from .hybrid_spec import block_spec as hybrid_block_spec
from .hybrid_spec import hybrid_kwargs
from .layout import Layout
from .run_config import RunConfig, spec_kwargs, transformer_kwargs
from .transformer_options import check_for_model


class SPRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with megatron's norm signature that accepts sequence parallelism (the local spec's
    WrappedTorchNorm asserts it away; MoE with TP needs SP in training)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def check_layout(arch: MoEArch, layout: Layout) -> None:
    layout.check_model(num_layers=arch.num_layers, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                       num_experts=arch.num_experts, moe_ffn=arch.moe_ffn_hidden_size,
                       ffn=None if all(arch.moe_layers) else arch.ffn_hidden_size)
    if arch.shared_expert_ffn and arch.shared_expert_ffn % layout.tp:
        raise ValueError(f"layout {layout.name}: tp={layout.tp} does not divide the shared expert's "
                         f"intermediate size {arch.shared_expert_ffn}")
    if arch.mla and arch.q_lora_rank and arch.q_lora_rank % layout.tp:
        # the local spec splits linear_q_down_proj's rows over TP (linear_kv_down_proj is duplicated)
        raise ValueError(f"layout {layout.name}: tp={layout.tp} does not divide the MLA down projection's rows "
                         f"q_lora_rank={arch.q_lora_rank}; tp must divide it")
    if arch.hybrid and arch.linear_layer_ids and arch.linear_num_key_heads % layout.tp:
        # GatedDeltaNet splits its key heads (and the value heads grouped under them) over TP
        raise ValueError(f"layout {layout.name}: tp={layout.tp} does not divide the delta-net's "
                         f"linear_num_key_heads={arch.linear_num_key_heads}")


def padded_vocab(arch: MoEArch, layout: Layout) -> int:
    return math.ceil(arch.vocab_size / layout.tp) * layout.tp


def transformer_config_kwargs(arch: MoEArch, layout: Layout, rc: RunConfig, **overrides) -> dict:
    """Every TransformerConfig argument for this model, layout and run config (pure)."""
    kw = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        num_moe_experts=arch.num_experts, moe_router_topk=arch.topk, moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_layer_freq=[int(m) for m in arch.moe_layers], moe_router_score_function=arch.score_function,
        moe_router_pre_softmax=arch.pre_softmax, moe_router_enable_expert_bias=arch.expert_bias,
        moe_router_bias_update_rate=0.0,             # the base model (and its routing bias) is frozen in LoRA RL
        moe_router_num_groups=arch.num_groups, moe_router_group_topk=arch.group_topk,
        moe_router_topk_scaling_factor=arch.scaling_factor,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn or None,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.tp > 1,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, apply_rope_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, moe_permute_fusion=False,
        moe_router_fusion=False,                     # the fused router bypasses router replay
        variable_seq_lengths=True,
        calculate_per_token_loss=True,              # loss functions here return sums already normalised globally
        **transformer_kwargs(rc),
    )
    if arch.mla:
        kw.update(mla_kwargs(arch))
    if arch.hybrid:
        kw.update(hybrid_kwargs(arch))
    kw.update(overrides)
    return kw


def mla_kwargs(arch: MoEArch) -> dict:
    """MLATransformerConfig fields of an MLA architecture (pure). qk_layernorm must be True: otherwise the local
    spec silently replaces the latent norms by IdentityOp. kv_channels = v_head_dim: the core attention's output
    width per head. rope: megatron's "rope" (no scaling: rotary_scaling_factor 1, mscale_all_dim 0, so the softmax
    scale is 1/sqrt(q_head_dim)) or "yarn" with HF's parameters; MLA computes its own rotary."""
    kw = dict(multi_latent_attention=True, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
              qk_head_dim=arch.qk_nope_head_dim, qk_pos_emb_head_dim=arch.qk_rope_head_dim,
              v_head_dim=arch.v_head_dim, kv_channels=arch.v_head_dim, num_query_groups=arch.num_heads,
              qk_layernorm=True, rotary_base=arch.rope_theta, rotary_percent=1.0)
    if arch.rope_type == "yarn":
        y = dict(arch.yarn)
        kw.update(rope_type="yarn", rotary_scaling_factor=y["factor"],
                  original_max_position_embeddings=int(y["original_max_position_embeddings"]),
                  beta_fast=y["beta_fast"], beta_slow=y["beta_slow"], mscale=y["mscale"],
                  mscale_all_dim=y["mscale_all_dim"])
    else:
        kw.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return kw


def transformer_config(arch: MoEArch, layout: Layout, rc: RunConfig | None = None, **overrides):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cls = MLATransformerConfig if arch.mla else TransformerConfig
    return cls(**transformer_config_kwargs(arch, layout, rc or RunConfig(), **overrides))


def _swap_classes(obj, swaps: dict, memo=None):
    """Replace classes throughout a (block) spec (shared sub-specs once): megatron's local norm by SPRMSNorm, and
    for MLA the local core attention by one that takes MLA's k_channels / v_channels."""
    memo = memo if memo is not None else {}
    if isinstance(obj, type) and obj in swaps:
        return swaps[obj]
    if id(obj) in memo:
        return memo[id(obj)]
    new = obj
    if isinstance(obj, list):
        new = [_swap_classes(o, swaps, memo) for o in obj]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = dataclasses.replace(obj, **{f.name: _swap_classes(getattr(obj, f.name), swaps, memo)
                                         for f in dataclasses.fields(obj) if f.init and f.name != "params"})
    memo[id(obj)] = new
    return new


def _local_swaps(arch: MoEArch, rc: RunConfig) -> dict:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    swaps = {WrappedTorchNorm: SPRMSNorm}
    if arch.mla:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from . import cpu_support

        if rc.device != "cpu" or cpu_support.active() is None:
            raise ValueError(f"MLA with layer_spec='local' on device={rc.device!r}: the local spec runs MLA only on "
                             "CPU with megatron's CPU support applied (run_config.prepare_host); on CUDA use "
                             "layer_spec='te'")
        swaps[DotProductAttention] = cpu_support.mla_core_attention()
    return swaps


def build_model(arch: MoEArch, layout: Layout, rc: RunConfig | None = None, *, grouped_experts: bool = False,
                transformer_overrides: Mapping | None = None, **config_overrides):
    """The GPTModel stage of this rank (parallel state must be initialised for `layout`), in rc's dtype on rc's
    device; rc (default: fp32 on CPU) is kept as model.run_config for the forward.

    transformer_overrides: the user's TransformerConfig options (transformer_options.transformer_options' result:
    activation recompute), checked against this model and layout (check_for_model, ValueError). With recompute the
    decoder's input is made to require grad (frozen_base_recompute).

    grouped_experts (or rc.grouped_experts): the legacy GroupedMLP (one weight1/weight2 for all local experts,
    grouped GEMM; megatron-core 0.16 only; on CPU its gmm is cpu_support.torch_gmm) instead of SequentialMLP."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    rc = rc or RunConfig()
    grouped_experts = grouped_experts or rc.grouped_experts
    check_layout(arch, layout)
    if arch.tie_embeddings and layout.pp > 1:
        raise ValueError(f"layout {layout.name}: tied input/output embeddings with pp={layout.pp} are not supported; "
                         "use pp=1")
    if grouped_experts:
        from .cpu_support import mcore_version

        if not mcore_version().startswith("0.16."):
            raise ValueError(f"grouped_experts=True: the legacy GroupedMLP was removed in megatron-core "
                             f"{mcore_version()}; use SequentialMLP (or TEGroupedMLP on GPU)")
        if rc.device == "cuda" and rc.dtype != "bf16":
            raise ValueError(f"grouped_experts=True with dtype={rc.dtype!r} on cuda: the grouped_gemm kernel is "
                             "bf16-only; use dtype='bf16'")
        if rc.layer_spec == "te":
            raise ValueError("grouped_experts=True with layer_spec='te': the TE spec has its own grouped experts "
                             "(TEGroupedMLP)")
        config_overrides = {"moe_grouped_gemm": True, "moe_use_legacy_grouped_gemm": True, **config_overrides}
    if arch.mla and not arch.q_lora_rank and rc.layer_spec == "local":
        from .cpu_support import mcore_version

        if not mcore_version().startswith("0.16."):
            raise ValueError(f"MLA with q_lora_rank null (Moonlight's) on megatron-core {mcore_version()} with "
                             "layer_spec='local': its MLA wants a norm fused into linear_q_proj, which the local "
                             "spec cannot build (and the HF model has no such norm); use megatron-core 0.16")
    if transformer_overrides:
        check_for_model(transformer_overrides, arch, layout)
        config_overrides = {**config_overrides, **transformer_overrides}
    cfg = transformer_config(arch, layout, rc, **config_overrides)
    spec = hybrid_block_spec(cfg, rc) if arch.hybrid else get_gpt_decoder_block_spec(cfg, **spec_kwargs(rc))
    if rc.layer_spec == "local":
        spec = _swap_classes(spec, _local_swaps(arch, rc))
    model = GPTModel(
        config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab(arch, layout),
        max_sequence_length=4096, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_embeddings, position_embedding_type="rope",
        rotary_percent=arch.rotary_percent, rotary_base=arch.rope_theta, parallel_output=True)
    if grouped_experts and rc.device == "cpu":
        _allow_fp32_grouped_mlp(model)
    if arch.mla and rc.layer_spec == "local":
        from . import cpu_support

        for layer in getattr(model.decoder, "layers", []):
            cpu_support.duplicated_kv_down(layer.self_attention)
    if rc.device == "cuda" and rc.cpu_init:
        model.cuda(torch.cuda.current_device())
    if cfg.recompute_granularity is not None:
        frozen_base_recompute(model)
    model.run_config = rc
    return model


def _input_requires_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


def frozen_base_recompute(model) -> None:
    """megatron-core's recompute (tensor_parallel.checkpoint) is torch's reentrant checkpoint: a checkpointed chunk's
    output requires grad only if one of its *inputs* does. With a frozen base nothing before the first adapter
    requires grad, so the chunk's adapters (and, with full recompute, every layer after it) would get no gradient
    and the loss none at all. The embedding's output is made to require grad in grad-enabled forwards (the usual
    fix for adapters under reentrant checkpointing); later pipeline stages receive an input that already does."""
    if getattr(model, "pre_process", False) and not getattr(model, "_recompute_hook", None):
        model._recompute_hook = model.embedding.register_forward_hook(_input_requires_grad)


def _allow_fp32_grouped_mlp(model) -> None:
    """GroupedMLP.forward asserts config.bf16 because the CUDA grouped_gemm kernel is bf16-only. The CPU gmm
    computes in any dtype, so each GroupedMLP gets its own config copy with the flag set; nothing else reads it."""
    import copy

    for m in model.modules():
        if type(m).__name__ == "GroupedMLP":
            m.config = copy.copy(m.config)
            m.config.bf16 = True
