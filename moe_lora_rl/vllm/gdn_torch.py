"""vLLM CPU Gated DeltaNet (Qwen3.5/3.6-MoE, Qwen3-Next) where the engine's kernels do not run: fp32 engines, and
head widths other than 64 and 128.

vLLM 0.32's `QwenGatedDeltaNetAttention.forward_cpu` hands the conv and the delta rule to the custom op
`cpu_gdn_attention_core` (model_executor/layers/mamba/ops/cpu/gdn_attention.py), which asserts bf16 inputs ("CPU GDN
attention requires BF16."): an fp32 engine starts and fails at its first request. Its chunked delta-rule kernel
(`chunk_gated_delta_rule_cpu`) runs key / value head widths 64 and 128 only ("Unexpected head dim size, 32"): a bf16
engine of a checkpoint with other widths (our tiny ones: 32) fails at its first prefill. This gives each such layer its
own forward: the same projections, called as modules (so LoRA hooks on in_proj_qkvz / in_proj_ba / out_proj see them),
the layer's own `_output_projection` (gated norm, out_proj), and between them the core in plain torch on the engine's
own state cache:

    conv      vLLM's torch causal conv (ops/cpu/causal_conv1d.py: causal_conv1d_fn_cpu for prefill chunks,
              causal_conv1d_update_cpu for decodes) on the layer's conv-state cache, as vLLM's non-AVX512-BF16 path
              runs it, on the unpacked weight (vLLM prepacks bf16 conv weights for its kernel and keeps the unpacked
              copy as `_cpu_unpacked_conv_weight`; fp32 weights are never packed)
    gating    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) in fp32, as transformers computes them
    rule      transformers' own torch_chunk_gated_delta_rule per prefill chunk (initial state read from the cache
              when vLLM says the sequence has one) and torch_recurrent_gated_delta_rule for the batched decodes (both
              in fp32); the final state written back to the request's slot, stored [slot, head, k, v] as vLLM's kernel
              stores it

Per instance, on a loaded model: apply(model) by the worker extension on its first moe_lora_* call (make_engine
makes that call before any request), CPU platform only, on the layers vLLM's kernels cannot run (needs_torch);
restore(model) undoes it. Speculative decoding (a wider conv-state buffer) is refused in one line. bf16 layers of
widths 64 / 128 keep vLLM's kernel. Drop when vLLM's CPU GDN op takes fp32 and any head width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .compat import check_vllm_version


KERNEL_DTYPES = (torch.bfloat16,)
KERNEL_HEAD_DIMS = (64, 128)
"""What vLLM 0.32's CPU delta-net kernels run (cpu_gdn_attention_core's assertion; chunk_gated_delta_rule_cpu's head
widths, measured by calling it with 32, 64, 128 and 256)."""


def needs_torch(layer) -> bool:
    """True when vLLM's CPU kernels cannot run this delta-net layer."""
    return (layer.in_proj_qkvz.weight.dtype not in KERNEL_DTYPES
            or layer.head_k_dim not in KERNEL_HEAD_DIMS or layer.head_v_dim not in KERNEL_HEAD_DIMS)


def gdn_layers(model) -> list:
    """The model's Qwen gated delta-net layers."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    return [m for m in model.modules() if isinstance(m, QwenGatedDeltaNetAttention)]


def _delta_rules():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (torch_chunk_gated_delta_rule,
                                                                       torch_recurrent_gated_delta_rule)

    return torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule


def _projections(layer, hidden_states):
    """(mixed_qkv, z [tokens, heads, v_dim], b, a) as vLLM's forward_cpu splits them."""
    mixed_qkvz, _ = layer.in_proj_qkvz(hidden_states)
    ba, _ = layer.in_proj_ba(hidden_states)
    if layer.gqa_interleaved_layout:                                 # Qwen3-Next: per-key-head interleaved
        from einops import rearrange

        query, key, value, z, b, a = layer.fix_query_key_value_ordering(mixed_qkvz, ba)
        query, key, value = (rearrange(x, "l p d -> l (p d)") for x in (query, key, value))
        return torch.cat((query, key, value), dim=-1), z, b, a
    qkv_size = (layer.key_dim * 2 + layer.value_dim) // layer.tp_size
    mixed_qkv, z = mixed_qkvz.split([qkv_size, layer.value_dim // layer.tp_size], dim=-1)
    b, a = ba.chunk(2, dim=-1)
    return mixed_qkv, z.reshape(z.size(0), -1, layer.head_v_dim), b, a


def _heads(layer, mixed_qkv):
    """query, key repeated per value head (transformers' repeat_interleave), value: [1, tokens, heads, dim]."""
    query, key, value = layer.rearrange_mixed_qkv(mixed_qkv)
    rep = value.shape[2] // query.shape[2]
    if rep > 1:
        query, key = query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2)
    return query, key, value


def core(layer, mixed_qkv, b, a, out) -> None:
    """The delta-net core of one forward into out [tokens, heads, v_dim], on the layer's state cache."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu, causal_conv1d_update_cpu

    meta = get_forward_context().attn_metadata
    if meta is None:                                   # profile run
        return
    m = meta[layer.prefix]
    if m.num_actual_tokens == 0:
        return
    width = layer.conv1d.weight.size(-1)
    conv_state = layer.kv_cache[0]
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)      # (slots, dim, state_len)
    if m.spec_sequence_masks is not None or conv_state.size(-1) != width - 1:
        raise ValueError("moe_lora_rl's torch delta-net path (fp32, or head widths vLLM's CPU kernel lacks) runs "
                         "without speculative decoding: turn speculative decoding off")
    weight = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)      # bf16: vLLM packed .weight for its kernel
    if weight is None:
        weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), width)
    ssm = layer.kv_cache[1]
    slots, heads, v_dim, k_dim = ssm.shape
    ssm = ssm.view(slots, heads, k_dim, v_dim)          # the layout vLLM's CPU kernel keeps
    idx, qsl = m.non_spec_state_indices_tensor, m.non_spec_query_start_loc
    chunk_rule, recurrent_rule = _delta_rules()
    a_log, dt_bias = layer.A_log.float(), layer.dt_bias.float()

    def gates(b_, a_):
        return b_.float().sigmoid()[None], (-a_log.exp() * F.softplus(a_.float() + dt_bias))[None]

    nd, ndt = m.num_decodes, m.num_decode_tokens
    if nd > 0:
        x = causal_conv1d_update_cpu(mixed_qkv[:ndt].contiguous(), conv_state, weight, layer.conv1d.bias,
                                     activation=layer.activation, conv_state_indices=idx[:nd])
        q, k, v = _heads(layer, x)
        beta, g = gates(b[:ndt], a[:ndt])
        # one token per decode: the batch on dim 0, as transformers' recurrent rule takes [batch, 1, heads, dim]
        o, state = recurrent_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.transpose(0, 1),
                                  beta.transpose(0, 1), initial_state=ssm[idx[:nd].long()].float(),
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        ssm[idx[:nd].long()] = state.to(ssm.dtype)
        out[:ndt] = o[:, 0].to(out.dtype)
    if m.num_prefills > 0:
        np_, end = m.num_prefills, ndt + m.num_prefill_tokens
        p_idx = idx[nd:nd + np_]
        p_qsl = qsl[nd:nd + np_ + 1] - ndt
        has_init = m.has_initial_state[nd:nd + np_]
        x = causal_conv1d_fn_cpu(mixed_qkv[ndt:end].transpose(0, 1), weight, layer.conv1d.bias, conv_state, p_qsl,
                                 cache_indices=p_idx, has_initial_state=has_init,
                                 activation=layer.activation).transpose(0, 1)
        q, k, v = _heads(layer, x)
        beta, g = gates(b[ndt:end], a[ndt:end])
        for i in range(np_):
            s, e, slot = int(p_qsl[i]), int(p_qsl[i + 1]), int(p_idx[i])
            init = ssm[slot:slot + 1].float() if bool(has_init[i]) else None
            o, state = chunk_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=init,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
            ssm[slot] = state[0].to(ssm.dtype)
            out[ndt + s:ndt + e] = o[0].to(out.dtype)


def _forward(layer):
    def forward(hidden_states):
        mixed_qkv, z, b, a = _projections(layer, hidden_states)
        out = torch.zeros(hidden_states.size(0), layer.num_v_heads // layer.tp_size, layer.head_v_dim,
                          dtype=hidden_states.dtype, device=hidden_states.device)
        core(layer, mixed_qkv, b, a, out)
        return layer._output_projection(out, z)

    forward.moe_lora_kernel = layer._forward_method
    return forward


def apply(model) -> int:
    """Give every delta-net layer vLLM's kernels cannot run the torch core; returns how many (0: not the CPU
    platform, no delta-net layer, or all run by vLLM's kernels). ValueError on a vLLM version the fix was not written
    for, before anything is changed. Idempotent."""
    check_vllm_version("the CPU torch Gated DeltaNet path (QwenGatedDeltaNetAttention.forward_cpu)")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    layers = [l for l in gdn_layers(model) if needs_torch(l)]
    for layer in layers:
        if not hasattr(layer._forward_method, "moe_lora_kernel"):
            layer._forward_method = _forward(layer)
    return len(layers)


def restore(model) -> None:
    for layer in gdn_layers(model):
        kernel = getattr(layer._forward_method, "moe_lora_kernel", None)
        if kernel is not None:
            layer._forward_method = kernel
