"""Every tolerance and target the checks, tests and benches assert or report, each with why it is that size.
Derivations too long for one line are in the docstring of the test named beside the value."""
from __future__ import annotations

import torch

BF16_UNIT_ROUNDOFF = 2.0 ** -8       # u: bf16 keeps 8 significant bits

# Megatron vs HF transformers, fp32 logits (magnitude ~5): reduction-order noise; a wrong shard differs by O(1).
PARITY_FP32 = 1e-4
# bf16 parity: median over tokens of max |logit diff| / max |ref|; every op rounds to u, measured 2-4u
# (tests/distributed/test_bf16.py).
PARITY_BF16 = 8 * BF16_UNIT_ROUNDOFF
# A model trained in bf16: the eval forward's 8u plus the rounding its adapters carry (test_bf16.py).
TRAINED_BF16 = 2 * PARITY_BF16

# LoRA after 3 AdamW steps (lr 1e-4) at any layout vs tp1ep1pp1: losses and gathered adapters; reduction-order
# noise becomes a fraction of lr per step (measured ~1e-6; tests/distributed/test_lora_layouts.py).
LORA_LAYOUT = 1e-5
# One update's adapter gradient (fp32, relative to its largest entry) of the same global batch padded wider, split
# into other micro-batches or data-parallel shares: the loss is the same function, only matmul shapes and the
# summation order change (measured up to 5.3e-6 for 1 vs 4 micro-batches in token-mean; tests/unit/
# test_policy_core.py). A normaliser that moves with the width is off by the widths' ratio (0.3 and more there).
GRAD_SPLIT = 2e-5
# One LoRA forward at another layout or with a megatron-core MoE option (ETP, TP with shared-expert overlap, the
# allgather dispatcher, grouped GEMM) vs the plain layout, fp32: max |logit diff| / max |reference logit| (logits ~25;
# measured up to 1.3e-6; a delta counted twice on one rank: 0.2-0.3; tests/distributed/test_moe_options.py). Their
# adapter gradients are held to GRAD_SPLIT (measured up to 9.1e-6).
LAYOUT_LOGITS_REL = 1e-5
# Logits of trained or cross-layout-loaded adapters vs the reference (fp32, magnitude ~5-20).
LORA_LOGITS = 1e-4
# Our PEFT export in HF transformers + peft vs Megatron+LoRA logits (fp32, magnitude ~20; peft adds B(Ax) unmerged).
PEFT_LOGITS = 1e-4
# A broken export (a factor changed) must move the logits by more than this.
PEFT_BROKEN_MIN = 1e-3

# R3: Megatron replaying forced routes vs HF forced to them. fp32: max |logit diff|; bf16: the worst token's
# max |logit diff| / max |reference logit|, 4x parity's median (test_bf16.py).
FIDELITY_TOL = {torch.float32: 1e-4, torch.bfloat16: 16 * BF16_UNIT_ROUNDOFF}
# fp32 on larger logits (the default glm4_moe/wide model's reach ~33; 128 experts, top-8): the same reduction-order
# noise relative to each token's largest reference logit (max |diff| / max |ref|); 1e-4 at logits of ~10.
FIDELITY_REL_FP32 = 1e-5
SHUFFLED_MIN = 1e-2                  # the shuffled-routes negative control must differ by more than this
# R3 on a bf16 engine: k3 of the engine's logprobs against fp32 Megatron replaying its routes, tiny models. Measured
# 0.003 (qwen3_moe) and 0.005 (glm4_moe, GQA; docs/r3.md), 0.0097 (deepseek_v3 tiny_rope, MLA); HF bf16 forced to
# the same routes is as far from HF fp32 (checks/mla_bf16.py), so this is bf16 rounding. Routing freely (no R3):
# 0.26-1.4; a rotary fault at positions > 0 (the CPU plain-RoPE kernel unfixed): 1.8-3.7 nats per token.
R3_BF16_K3 = 0.02

# vLLM prompt logprobs vs Megatron+LoRA after a refit (same fp32 math, measured ~1e-5; the base differs by >1e-2).
REFIT_LOGPROBS = 1e-3
# vLLM logprobs of tokens decoded across adapter commits vs HF run position by position with each position's version
# and the captured routes forced (fp32, tests/e2e/test_inflight.py).
INFLIGHT_LOGPROBS = 1e-4
# mode=async: a trained token's engine logprob vs HF with its version's adapter and the replayed routes (fp32, tiny
# model): the vLLM-vs-HF fp32 kernel noise alone reaches 1.6e-5 on single-version samples of the base model; the
# per-sample k3 KL stays ~1e-11 (tests/e2e/test_async.py).
TRAINED_SERVED_LOGPROBS = 3e-5
TRAINED_SERVED_K3 = 1e-10
# the same on the long task (the wide default model, answers up to 400 tokens; tests/e2e/test_async_long.py): with
# every version's adapter equal (no answer rewarded, so no update moved them), the vLLM-vs-HF fp32 noise alone
# reached 8.3e-5 over 320 samples (per-sample k3 3.4e-11)
TRAINED_SERVED_LOGPROBS_LONG = 2e-4
# importance-based KV eviction: the engine's logprobs vs HF with the held tokens of each query as its mask (fp32,
# 116-token sequences, tests/e2e/test_sparse_evict.py): measured 1.1e-5
SPARSE_EVICT_LOGPROBS = 3e-5
ADAPTER_MATTERS_MIN = 1e-2           # base vs LoRA logprobs: the adapter must move them by more than this

# LoRA training peak RSS / full fine-tuning peak RSS (bench lora, medium model): frozen base, no base grads or moments.
PEAK_RATIO_TARGET = 0.7
# Planner prediction vs measurement at another batch size (bench plan): relative error of steps per minute.
PLAN_ERROR_TARGET = 0.25
