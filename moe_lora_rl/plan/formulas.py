"""Every formula the layout planner uses: one pure function each, with its source. Units: bytes, seconds, FLOPs,
tokens, samples (one sample = one prompt + its response). Parameter and adapter counts are not here: they come from
the refit calculator (moe_lora_rl/plan/refit_calc.py), so both tools give the same numbers."""
from __future__ import annotations

import math


# --- model shape -----------------------------------------------------------------------------------------------

def active_params(total: int, moe_layers: int, experts: int, top_k: int, hidden: int, expert_ffn: int) -> int:
    """Parameters a token touches. A GLU expert has 3*H*F weights and a token uses top_k of the E routed experts
    (Shazeer et al. 2017, sparsely-gated MoE; the GLU shape as in refit_calc.py's docstring)."""
    return total - moe_layers * (experts - top_k) * 3 * hidden * expert_ffn


def kv_bytes_per_token_gqa(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """K and V vectors of every KV head in every layer (Pope et al. 2022, 'Efficiently Scaling Transformer
    Inference', sec. 2; vLLM sizes its paged cache the same way)."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_bytes_per_token_mla(layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: float) -> float:
    """MLA caches one compressed latent (kv_lora_rank) plus the decoupled RoPE key (rope_dim) per token per layer,
    shared by all heads (DeepSeek-V2 paper, arXiv 2405.04434, sec. 2.1.2-2.1.3)."""
    return layers * (kv_lora_rank + rope_dim) * dtype_bytes


def expected_active_experts(experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts a batch of `tokens` tokens touches in one layer, if each token picks top_k of E uniformly
    (a balanced router): E * (1 - (1 - k/E)^tokens). Derived here (inclusion probability of one expert)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


# --- memory ----------------------------------------------------------------------------------------------------

def frozen_weight_bytes(params: float, bytes_per_param: float, shards: int) -> float:
    """A frozen base is stored once, in its dtype, split evenly over `shards` ranks."""
    return params * bytes_per_param / shards


def trainable_state_bytes(params: float, shards: int, param_bytes: float = 2, grad_bytes: float = 4,
                          optimizer_bytes: float = 12, optimizer_shards: int = 1) -> float:
    """Mixed-precision Adam on the adapters only: bf16 weights (2), an fp32 gradient buffer (4, Megatron's
    main_grad) and fp32 master weights + momentum + variance (12; ZeRO paper, Rajbhandari et al. 2020, sec. 3.1:
    'K = 12'). The distributed optimizer shards the 12 over data-parallel replicas (`optimizer_shards`)."""
    local = params / shards
    return local * (param_bytes + grad_bytes) + local * optimizer_bytes / optimizer_shards


def checkpointed_activation_bytes(seq: int, micro_batch: int, hidden: int, layers_in_stage: int, tp: int,
                                  in_flight: int, dtype_bytes: float = 2) -> float:
    """Full activation recomputation keeps only each layer's input, s*b*h values per layer, split over TP by
    sequence parallelism (Korthikanti et al. 2022, 'Reducing Activation Recomputation', sec. 4.1 and 4.2.2);
    1F1B keeps up to `in_flight` = pp microbatches alive on the first stage (ibid. sec. 4.2.3)."""
    return in_flight * layers_in_stage * seq * micro_batch * hidden * dtype_bytes / tp


def layer_working_bytes(seq: int, micro_batch: int, hidden: int, tp: int, top_k: int, expert_ffn: int) -> float:
    """Activations of the one layer being recomputed and back-propagated, with flash attention (no s^2 term) and
    sequence parallelism. Attention + norms: 15*s*b*h bytes (Korthikanti et al. 2022, eq. 1: 11sbh attention +
    4sbh layer norms); the GLU MoE MLP by the same per-tensor accounting: the bf16 input (2h) and, per routed copy,
    the dispatched input (2h), fc1 output (2*2F) and activation output (2F)."""
    attn = 15 * hidden
    moe = 2 * hidden + top_k * (2 * hidden + 4 * expert_ffn + 2 * expert_ffn)
    return seq * micro_batch * (attn + moe) / tp


def logits_bytes(seq: int, micro_batch: int, vocab: int, tp: int) -> float:
    """The last stage's vocab-parallel logits in fp32 for the cross-entropy (Megatron's vocab_parallel_cross_entropy
    upcasts to fp32): s*b*V*4 bytes over TP."""
    return seq * micro_batch * vocab * 4 / tp


def recurrent_state_bytes_per_seq(layers: int, conv_kernel: int, conv_dim: int, value_heads: int,
                                  key_head_dim: int, value_head_dim: int, conv_bytes: float,
                                  state_bytes: float) -> float:
    """A hybrid model's fixed per-sequence state, whatever its length: per Gated DeltaNet layer the causal conv's
    last kernel-1 inputs over its conv_dim = 2 key_dim + value_dim channels, and the delta rule's state, one
    key_head_dim x value_head_dim matrix per value head (vLLM 0.32, MambaStateShapeCalculator.
    gated_delta_net_state_shape; both in the model dtype unless mamba_ssm_cache_dtype says otherwise,
    MambaStateDtypeCalculator.gated_delta_net_state_dtype). The full-attention layers' KV is per token (above)."""
    return layers * ((conv_kernel - 1) * conv_dim * conv_bytes + value_heads * key_head_dim * value_head_dim
                     * state_bytes)


def kv_concurrency(free_bytes: float, kv_bytes_per_token_per_gpu: float, seq_len: int,
                   state_bytes_per_seq_per_gpu: float = 0.0) -> int:
    """Sequences whose whole context fits in the KV budget at once (vLLM's max concurrency report: KV cache
    tokens / max_model_len); a hybrid's sequence also holds its recurrent state (recurrent_state_bytes_per_seq).
    vLLM pads an attention page to the state's page size; that padding is not counted."""
    return max(0, int(free_bytes // (kv_bytes_per_token_per_gpu * seq_len + state_bytes_per_seq_per_gpu)))


# --- time ------------------------------------------------------------------------------------------------------

def attention_flops_per_token(layers: int, ctx: float, qk_dim: int, v_dim: int) -> float:
    """Forward attention-score and value FLOPs of one token attending to `ctx` tokens: 2*ctx*qk_dim (Q K^T) +
    2*ctx*v_dim (A V) per layer (PaLM, Chowdhery et al. 2022, appendix B: 6N + 12*L*H*Q*T training FLOPs per
    token, i.e. 4*L*H*Q*T forward for qk_dim = v_dim = H*Q, context T)."""
    return 2 * layers * ctx * (qk_dim + v_dim)


def delta_rule_flops_per_token(layers: int, value_heads: int, key_head_dim: int, value_head_dim: int) -> float:
    """Forward FLOPs of the gated delta rule's recurrence per token, independent of the context: per value head
    S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T and o_t = S_t q_t (Yang, Kautz & Hatamizadeh 2024, 'Gated
    Delta Networks: Improving Mamba2 with Delta Rule', arXiv 2412.06464), computed as a_t S + (b_t v_t - a_t b_t S k_t)
    k_t^T: S k, the rank-one update and S q at 2 dk dv each and the decay dk dv, 7 dk dv in all (derived here; the
    chunked form used in training does matmuls of the same order)."""
    return 7 * layers * value_heads * key_head_dim * value_head_dim


def lora_train_flops_per_token(active: float, adapter_active: float, attn_fwd: float, recompute: bool) -> float:
    """Forward 2N; backward to activations 2N; the frozen base skips the 2N weight gradient (Kaplan et al. 2020:
    6N for full training; 'LoRA Without Regret', Thinking Machines 2025: LoRA costs ~2/3 of full fine-tuning).
    Adapters train fully (6 N_a). Attention has no weights: backward = 2x forward. Full recomputation repeats
    the forward once more (Korthikanti et al. 2022, sec. 4.1)."""
    fwd = 2 * active + 2 * adapter_active + attn_fwd
    return fwd * (2 if recompute else 1) + 2 * active + 4 * adapter_active + 2 * attn_fwd


def pipeline_bubble_fraction(pp: int, microbatches: int) -> float:
    """1F1B idle fraction of a step: (p-1) / (m + p-1) (Narayanan et al. 2021, 'Efficient Large-Scale Language
    Model Training on GPU Clusters using Megatron-LM', sec. 2.2.1: bubble (p-1)/m of the ideal time)."""
    return (pp - 1) / (microbatches + pp - 1)


def train_seconds(tokens: float, flops_per_token: float, gpus: int, peak_flops: float, mfu: float,
                  bubble: float) -> float:
    """Compute-bound training: FLOPs / (GPUs * peak * MFU), stretched by the pipeline bubble."""
    return tokens * flops_per_token / (gpus * peak_flops * mfu * (1.0 - bubble))


def decode_step_seconds(bytes_read: float, flops: float, mem_bw: float, peak_flops: float) -> float:
    """One decode step of a batch: the roofline (Williams et al. 2009, 'Roofline: an insightful visual performance
    model'): the slower of moving the bytes (weights the batch touches + KV read) at the achieved bandwidth and
    doing the FLOPs at the achieved compute rate. `mem_bw` and `peak_flops` are achieved figures (datasheet x
    efficiency, or calibrated)."""
    return max(bytes_read / mem_bw, flops / peak_flops)


def rollout_batch_seconds(samples: int, engines: int, concurrency: int, response_len: int,
                          step_seconds: float) -> float:
    """Synchronous generation of `samples` sequences on `engines` engines of `concurrency` slots, all of
    `response_len` tokens: ceil(samples / slots) waves of response_len decode steps."""
    return math.ceil(samples / (engines * concurrency)) * response_len * step_seconds


def production_rate(engines: int, concurrency: int, response_len: int, step_seconds: float) -> float:
    """Samples/s the engines finish in steady state (continuous batching): slots / time per sequence."""
    return engines * concurrency / (response_len * step_seconds)


def consumption_rate(samples: int, train_step_seconds: float) -> float:
    """Samples/s the trainer consumes: one batch per optimizer step."""
    return samples / train_step_seconds


def sync_step_seconds(rollout_s: float, train_s: float, refit_s: float) -> float:
    """Synchronous RL: generate, then train, then push the adapters; nothing overlaps."""
    return rollout_s + train_s + refit_s


def max_staleness(generation_s: float, step_s: float) -> int:
    """Policy versions a sample can lag with in-flight weight updates (PipelineRL, arXiv 2509.19128): a sequence
    generated over `generation_s` while the trainer steps every `step_s` mixes ceil(generation_s / step_s)
    versions behind the newest (the 'max_staleness' invariant of the optimal-layout talk)."""
    return math.ceil(generation_s / step_s - 1e-9)


def async_step_seconds(train_s: float, produce_s: float, refit_s: float, generation_s: float,
                       staleness: int) -> tuple[float, str]:
    """Asynchronous (pipeline) RL: the step is set by the slowest of consuming a batch (training), producing one
    (generation + the engines' pause for the adapter push), and the staleness bound (a step may not be shorter
    than generation_s / staleness, or a sample would lag more than `staleness` versions). Returns (seconds,
    which bound)."""
    if staleness < 1:
        raise ValueError(f"staleness bound {staleness}: asynchronous RL needs a bound >= 1 (0 is synchronous)")
    terms = {"consumption (training)": train_s, "production (rollout)": produce_s + refit_s,
             "staleness": generation_s / staleness}
    name = max(terms, key=terms.get)
    return terms[name], name


# --- response lengths (plan/lengths.py holds the distributions) ----------------------------------------------

def shrinking_batch_seconds(alive_steps, step_seconds_at) -> float:
    """A static batch decoded until its longest answer ends, the batch shrinking as short answers finish (PipelineRL,
    arXiv 2509.19128, sec. 2: 'the effective batch size decreases as sequences finish'): sum_k G_k * step(k), with
    G_k the expected decode steps during which exactly k answers run (lengths.py). Exact in expectation for any
    step-time function (linearity over steps); with one length L it is L * step(n)."""
    return sum(g * step_seconds_at(k) for k, g in enumerate(alive_steps, start=1) if g > 0)


def rollout_sync_seconds_lengths(per_engine: int, concurrency: int, dist, step_seconds_at) -> float:
    """Synchronous generation of `per_engine` answers on one engine of `concurrency` slots. Up to one slot each:
    the shrinking batch above. More answers than slots, one length: ceil(n/c) whole waves (continuous batching
    cannot help). More answers than slots, several lengths: continuous batching keeps the c slots full until the
    queue empties, after (n - c) answers, i.e. (n - c) * mean / c steps at step(c) (fluid approximation), then the
    last c drain as a shrinking batch of c fresh draws (approximation: their left-over lengths are treated as whole
    answers)."""
    n, c = per_engine, concurrency
    if n <= c:
        return shrinking_batch_seconds(dist.alive_steps(n), step_seconds_at)
    if dist.fixed:
        return math.ceil(n / c) * dist.values[0] * step_seconds_at(c)
    return (n - c) * dist.mean / c * step_seconds_at(c) + shrinking_batch_seconds(dist.alive_steps(c),
                                                                                  step_seconds_at)


def full_occupancy_seconds_per_sample(mean_len: float, concurrency: int, step_s: float) -> float:
    """Pipelined (async) generation keeps every slot busy, a finished answer's slot refilled at once (PipelineRL,
    sec. 3; AReaL, arXiv 2505.24298, sec. 4): by renewal, a slot finishes an answer every mean_len steps, so one
    sample costs mean_len * step(c) / c seconds of the engine."""
    return mean_len * step_s / concurrency


def admission_ahead(in_flight: int, batch: int) -> int:
    """Updates the producer admits ahead of the pushes to keep `in_flight` answers running while the trainer
    consumes `batch` per update. rl/groups.py's gate admits groups planned for updates pushes .. pushes + k, so
    (k + 1) batches may be in flight: the one the trainer waits for and k ahead; in_flight answers need
    ceil(in_flight / batch) - 1 ahead, and at least 1 for the pipeline to overlap at all."""
    return max(1, math.ceil(in_flight / batch) - 1)


def implied_staleness(ahead: int, longest_generation_s: float, step_s: float) -> int:
    """The most pushes a trained sample lags: admitted `ahead` updates before its own, it lags that many; an answer
    still generating when its update comes lags ceil(generation / step) (max_staleness above)."""
    return max(ahead, max_staleness(longest_generation_s, step_s))
