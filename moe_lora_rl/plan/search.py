"""Enumerate layouts and pick a plan: every (training GPUs, rollout GPUs) split in whole nodes, for each the
fastest training layout (TP/ETP/EP/PP/DP) and rollout engines (engines x TP/EP) that fit in memory, then the split
with the most RL steps per minute in the chosen mode. Pure: numbers in, a frozen Plan out.

Invariants (Garg & Li, Applied Compute, "Efficient Reinforcement Learning" talk, 2025, slide "Figuring out the
optimal layout"): training consumption rate == rollout production rate; the staleness of any sample <= the bound.
Memory decides what fits."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from . import formulas as F
from .refit_calc import expert_adapter_params, other_adapter_params, refit_report
from .specs import Hardware, ModelSpec, RLSettings

GB = 1e9
_TP = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class TrainLayout:
    gpus: int
    tp: int
    etp: int
    ep: int
    pp: int
    dp: int
    microbatches: int
    memory_GB: dict

    @property
    def name(self) -> str:
        return f"tp{self.tp}etp{self.etp}ep{self.ep}pp{self.pp}dp{self.dp}"


@dataclass(frozen=True)
class RolloutLayout:
    gpus: int
    engines: int
    engine_gpus: int
    tp: int                 # attention/dense TP inside an engine; attention DP = engine_gpus / tp
    ep: int                 # experts spread over all GPUs of the engine
    concurrency: int        # sequences in flight per engine (KV-cache bound, capped by max_num_seqs per DP rank)
    memory_GB: dict
    kv_bound: bool = False  # the KV cache, not max_num_seqs, sets the concurrency

    @property
    def name(self) -> str:
        return f"{self.engines}x(tp{self.tp}ep{self.ep})"


@dataclass(frozen=True)
class Plan:
    model: str
    gpus: int
    settings: dict
    hardware: dict
    adapter: dict
    training: dict
    rollout: dict
    rates: dict
    lengths: dict
    staleness: dict
    times_s: dict
    steps_per_min: dict
    max_staleness: int | None
    binding: dict

    def to_dict(self) -> dict:
        return asdict(self)


def adapter_counts(m: ModelSpec, rl: RLSettings) -> tuple[int, int]:
    """(routed-expert adapter params, other adapter params): the refit calculator's formulas."""
    return expert_adapter_params(m.moe, rl.rank, rl.adapter_layout), other_adapter_params(m.moe, rl.rank)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def train_memory(m: ModelSpec, hw: Hardware, rl: RLSettings, tp: int, etp: int, ep: int, pp: int, dp: int,
                 train_weight_bytes: float) -> dict:
    """Per-GPU bytes (GB) of the fullest pipeline stage."""
    L, H, V = m.moe.num_layers, m.moe.hidden, m.moe.vocab
    stage = math.ceil(L / pp)
    f = stage / L                                   # uneven stages: the fullest holds ceil(L/pp) layers
    emb = V * H * (2 if pp == 1 else 1)             # input embedding on the first stage, output layer on the last
    exp_a, oth_a = adapter_counts(m, rl)
    edp = tp * dp // (ep * etp)
    weights = (F.frozen_weight_bytes(m.expert_params * f, train_weight_bytes, ep * etp)
               + F.frozen_weight_bytes((m.dense_params - 2 * V * H) * f + emb, train_weight_bytes, tp))
    adapters = (F.trainable_state_bytes(exp_a * f, ep * etp, optimizer_bytes=0)
                + F.trainable_state_bytes(oth_a * f, tp, optimizer_bytes=0))
    optimizer = (F.trainable_state_bytes(exp_a * f, ep * etp, 0, 0, 12, edp)
                 + F.trainable_state_bytes(oth_a * f, tp, 0, 0, 12, dp))
    mbs = rl.batch // dp // rl.micro_batch
    s, b = rl.seq_len, rl.micro_batch
    if rl.recompute:
        acts = (F.checkpointed_activation_bytes(s, b, H, stage, tp, min(pp, mbs))
                + F.layer_working_bytes(s, b, H, tp, m.top_k, m.moe.expert_ffn))
    else:
        acts = min(pp, mbs) * stage * F.layer_working_bytes(s, b, H, tp, m.top_k, m.moe.expert_ffn)
    acts += F.logits_bytes(s, b, V, tp)
    out = {"weights": weights, "adapters": adapters, "optimizer": optimizer, "activations": acts}
    out = {k: v / GB for k, v in out.items()}
    out["total"] = sum(out.values())
    out["budget"] = hw.memory_GB * hw.usable_fraction
    return out


def train_layouts(m: ModelSpec, hw: Hardware, rl: RLSettings, gpus: int, train_weight_bytes: float):
    """Every layout that divides `gpus` (fitting or not), fastest first (smallest bubble, then least memory)."""
    out = []
    for tp in _TP:
        if tp > hw.gpus_per_node or gpus % tp or m.heads % tp or (not m.mla and m.kv_heads % tp):
            continue
        for pp in _divisors(gpus // tp):
            if pp > m.moe.num_layers:
                continue
            dp = gpus // (tp * pp)
            if rl.batch % (dp * rl.micro_batch):
                continue
            for etp in sorted({1, tp}):
                for ep in _divisors(m.moe.experts):
                    if (gpus // pp) % (ep * etp):
                        continue
                    mem = train_memory(m, hw, rl, tp, etp, ep, pp, dp, train_weight_bytes)
                    out.append(TrainLayout(gpus, tp, etp, ep, pp, dp, rl.batch // dp // rl.micro_batch, mem))
    out.sort(key=lambda t: (F.pipeline_bubble_fraction(t.pp, t.microbatches), t.memory_GB["total"]))
    return out


def rollout_memory(m: ModelSpec, hw: Hardware, rl: RLSettings, g: int, tp: int, rollout_weight_bytes: float):
    """Per-GPU GB of an engine of g GPUs: experts over all g (EP), attention/dense over TP (replicated per attention
    DP group), adapters in bf16 alike; the KV cache takes what is left of the budget."""
    exp_a, oth_a = adapter_counts(m, rl)
    weights = (F.frozen_weight_bytes(m.expert_params, rollout_weight_bytes, g)
               + F.frozen_weight_bytes(m.dense_params, rollout_weight_bytes, tp)) / GB
    adapters = (F.frozen_weight_bytes(exp_a, 2, g) + F.frozen_weight_bytes(oth_a, 2, tp)) / GB
    budget = hw.memory_GB * hw.usable_fraction
    return {"weights": weights, "adapters": adapters, "kv_cache": max(0.0, budget - weights - adapters),
            "total": budget if budget > weights + adapters else weights + adapters, "budget": budget}


def kv_per_token_per_gpu(m: ModelSpec, tp: int) -> float:
    return m.kv_bytes_per_token / (1 if m.mla else min(tp, m.kv_heads))


def state_per_seq_per_gpu(m: ModelSpec, tp: int) -> float:
    """A hybrid's recurrent state of one sequence on one GPU: vLLM splits the conv channels and the value heads
    over TP (gated_delta_net_state_shape), so TP divides it (rollout_layouts keeps TP a divisor of the key heads)."""
    return m.state_bytes_per_seq / tp


def seq_bytes_per_gpu(m: ModelSpec, tp: int, tokens: float) -> float:
    """KV of `tokens` tokens plus the recurrent state: what one sequence holds in the rollout cache of a GPU."""
    return kv_per_token_per_gpu(m, tp) * tokens + state_per_seq_per_gpu(m, tp)


def decode_traffic(m: ModelSpec, rl: RLSettings, r: RolloutLayout, concurrency: int,
                   rollout_weight_bytes: float) -> tuple[float, float]:
    """(bytes read, FLOPs) per GPU of one decode step of an engine running `concurrency` sequences at the mean
    context (prompt + the token-weighted mean position in an answer, response/2 for one length): the weights of the
    experts the batch touches, dense weights, adapters, KV, and a hybrid's recurrent state (read and written once
    a step)."""
    g, tp = r.engine_gpus, r.tp
    ctx = rl.prompt_len + rl.length_dist.decode_context
    active = F.expected_active_experts(m.moe.experts, m.top_k, concurrency) / m.moe.experts
    exp_a, oth_a = adapter_counts(m, rl)
    weights = ((m.expert_params * rollout_weight_bytes + exp_a * 2) * active / g
               + (m.dense_params * rollout_weight_bytes + oth_a * 2) / tp)
    kv = concurrency / (g // tp) * (ctx * kv_per_token_per_gpu(m, tp) + 2 * state_per_seq_per_gpu(m, tp))
    flops = concurrency * (2 * (m.active_params + (exp_a * m.top_k / m.moe.experts + oth_a))
                           + mixing_flops_per_token(m, ctx)) / g
    return weights + kv, flops


def decode_step_seconds(m: ModelSpec, hw: Hardware, rl: RLSettings, r: RolloutLayout, concurrency: int,
                        rollout_weight_bytes: float) -> float:
    nbytes, flops = decode_traffic(m, rl, r, concurrency, rollout_weight_bytes)
    return F.decode_step_seconds(nbytes, flops, hw.hbm_GBps * 1e9 * hw.decode_bw_eff,
                                 hw.bf16_TFLOPs * 1e12 * hw.decode_flops_eff)


def mixing_flops_per_token(m: ModelSpec, ctx: float) -> float:
    """Forward token-mixing FLOPs with no weights: attention over `ctx` in the full layers, the delta rule's
    recurrence in a hybrid's linear layers."""
    gdn = m.moe.delta_net
    rule = F.delta_rule_flops_per_token(m.moe.linear_layers, gdn.value_heads, gdn.key_head_dim,
                                        gdn.value_head_dim) if gdn else 0.0
    return F.attention_flops_per_token(m.moe.full_layers, ctx, m.qk_dim, m.v_dim) + rule


def train_flops_per_token(m: ModelSpec, rl: RLSettings) -> float:
    exp_a, oth_a = adapter_counts(m, rl)
    attn = mixing_flops_per_token(m, rl.train_context)
    return F.lora_train_flops_per_token(m.active_params, exp_a * m.top_k / m.moe.experts + oth_a, attn,
                                        rl.recompute)


def rollout_layouts(m: ModelSpec, hw: Hardware, rl: RLSettings, gpus: int, rollout_weight_bytes: float):
    """Every engine shape that divides `gpus`, with its KV-bound concurrency (0 = does not fit)."""
    out = []
    sizes = [g for g in _divisors(gpus) if g & (g - 1) == 0 and (g == 1 or m.moe.experts % g == 0)]
    for g in sizes:
        for tp in _TP:
            if tp > min(g, hw.gpus_per_node) or g % tp or m.heads % tp or (m.state_heads and m.state_heads % tp):
                continue
            mem = rollout_memory(m, hw, rl, g, tp, rollout_weight_bytes)
            per_rank = F.kv_concurrency(mem["kv_cache"] * GB, kv_per_token_per_gpu(m, tp), rl.seq_len,
                                        state_per_seq_per_gpu(m, tp))
            conc = (g // tp) * min(per_rank, rl.max_engine_concurrency)
            out.append(RolloutLayout(gpus, gpus // g, g, tp, g, conc, mem, per_rank < rl.max_engine_concurrency))
    return out


def step_times(m: ModelSpec, hw: Hardware, rl: RLSettings, t: TrainLayout, r: RolloutLayout, refit_s: float,
               rwb: float) -> dict:
    """Step times, rates and binding terms of one (training layout, rollout layout) pair, sync and async. Answers
    follow rl.length_dist: sync waits for the longest of each engine's share (the batch shrinking as answers
    finish), async keeps the slots full and pays the mean; the staleness bound holds the longest of a batch."""
    d = rl.length_dist
    fpt = train_flops_per_token(m, rl)
    bubble = F.pipeline_bubble_fraction(t.pp, t.microbatches)
    train_s = F.train_seconds(rl.batch * (rl.prompt_len + d.mean), fpt, t.gpus, hw.bf16_TFLOPs * 1e12,
                              hw.train_mfu, bubble)
    step_at = lambda k: decode_step_seconds(m, hw, rl, r, k, rwb)
    # sync: the batch spread over the engines, each running until its share's longest answer ends
    per_engine = math.ceil(rl.batch / r.engines)
    c_sync = min(r.concurrency, per_engine)
    roll_sync = F.rollout_sync_seconds_lengths(per_engine, c_sync, d, step_at)
    out = {"train_s": train_s, "rollout_sync_s": roll_sync, "refit_s": refit_s, "pipeline_bubble": bubble,
           "sync_step_s": F.sync_step_seconds(roll_sync, train_s, refit_s), "decode_step_ms_sync": step_at(c_sync) * 1e3,
           "concurrency_sync": c_sync, "consumption_samples_per_s": F.consumption_rate(rl.batch, train_s),
           "mean_response_len": d.mean, "longest_response_len": d.expected_max(rl.batch),
           "rollout_sync_samples_per_s": rl.batch / roll_sync}
    terms = {"rollout": roll_sync, "training": train_s, "refit": refit_s}
    out["sync_binding"] = max(terms, key=terms.get)
    # async: engines kept full in steady state at the mean length, in flight at most ahead + 1 batches (the gate);
    # a lower concurrency shortens each answer's generation, which the staleness bound may prefer: try the
    # KV-bound concurrency (capped by the admission ahead) and its halvings
    best = None
    cap = max(1, (rl.ahead_limit + 1) * rl.batch // r.engines) if rl.staleness >= 1 else r.concurrency
    tries = sorted({min(r.concurrency >> i, cap) for i in range(r.concurrency.bit_length())}, reverse=True)
    for c in tries:
        step = step_at(c)
        prod = 1.0 / F.full_occupancy_seconds_per_sample(d.mean, r.engines * c, step)
        gen_s = d.mean * step
        gen_long = out["longest_response_len"] * step
        cand = {"produce_batch_async_s": rl.batch / prod, "generation_s": gen_s, "longest_generation_s": gen_long,
                "decode_step_ms_async": step * 1e3, "production_samples_per_s": prod, "concurrency_async": c}
        if rl.staleness >= 1:
            cand["async_step_s"], cand["async_binding"] = F.async_step_seconds(train_s, rl.batch / prod, refit_s,
                                                                               gen_long, rl.staleness)
            cand["ahead"] = F.admission_ahead(r.engines * c, rl.batch)
            cand["max_staleness"] = F.implied_staleness(cand["ahead"], gen_long, cand["async_step_s"])
        if best is None or cand.get("async_step_s", 0) < best.get("async_step_s", 0):
            best = cand
        if rl.staleness < 1:
            break
    out.update(best)
    return out


def _pools(gpus: int, hw: Hardware) -> list[int]:
    """Rollout pool sizes: whole nodes when the job spans nodes."""
    if gpus < 2:
        raise ValueError(f"GPU count {gpus}: no layout divides it; a plan needs >= 2 GPUs (one pool for training, "
                         "one for rollout)")
    n = hw.gpus_per_node
    if gpus <= n:
        return list(range(1, gpus))
    if gpus % n:
        raise ValueError(f"GPU count {gpus}: no layout divides it; with {n} GPUs per node the training and rollout "
                         f"pools are whole nodes, and {gpus} is {gpus % n} GPUs off a whole number of nodes "
                         f"(use {gpus - gpus % n} or {gpus + n - gpus % n})")
    return list(range(n, gpus, n))


def plan(m: ModelSpec, hw: Hardware, rl: RLSettings, gpus: int, train_weight_bytes: float | None = None,
         rollout_weight_bytes: float | None = None) -> Plan:
    twb = m.weight_bytes if train_weight_bytes is None else train_weight_bytes
    rwb = m.weight_bytes if rollout_weight_bytes is None else rollout_weight_bytes
    exp_a, oth_a = adapter_counts(m, rl)
    key = f"{rl.adapter_layout}/r{rl.rank}"
    refit = refit_report(m.moe, ranks=(rl.rank,), layouts=(rl.adapter_layout,), bytes_per_param=2,
                         link_gbps=hw.link_GBps)["adapters"][key]
    best, closest_fail, divides = None, None, False
    for n_roll in _pools(gpus, hw):
        n_train = gpus - n_roll
        tl = train_layouts(m, hw, rl, n_train, twb)
        rls = rollout_layouts(m, hw, rl, n_roll, rwb)
        if not tl or not rls:
            continue
        divides = True
        t_fit = [t for t in tl if t.memory_GB["total"] <= t.memory_GB["budget"]]
        r_fit = [r for r in rls if r.concurrency >= 1]
        if not t_fit or not r_fit:
            fails = []
            if not t_fit:
                t = min(tl, key=lambda x: x.memory_GB["total"])
                fails.append((t.memory_GB["total"] - t.memory_GB["budget"], "training memory",
                              f"{n_train} training GPUs at {t.name} need {t.memory_GB['total']:.1f} GB per GPU "
                              f"(weights {t.memory_GB['weights']:.1f}, adapters {t.memory_GB['adapters']:.1f}, "
                              f"optimizer {t.memory_GB['optimizer']:.1f}, activations "
                              f"{t.memory_GB['activations']:.1f})"))
            if not r_fit:
                r = max(rls, key=lambda x: x.memory_GB["kv_cache"] - x.memory_GB["weights"] - x.memory_GB["adapters"])
                one = seq_bytes_per_gpu(m, r.tp, rl.seq_len) / GB
                need = r.memory_GB["weights"] + r.memory_GB["adapters"] + one
                fails.append((need - r.memory_GB["budget"], "rollout memory",
                              f"{n_roll} rollout GPUs as {r.name} need {need:.1f} GB per GPU (weights "
                              f"{r.memory_GB['weights']:.1f}, adapters {r.memory_GB['adapters']:.1f}, KV cache "
                              f"(and recurrent state) of one {rl.seq_len}-token sequence {one:.2f})"))
            short = max(fails)
            if closest_fail is None or short[0] < closest_fail[0]:
                closest_fail = (short[0], short[1], "; ".join(f[2] for f in fails))
            continue
        t = t_fit[0]
        for r in r_fit:
            s = step_times(m, hw, rl, t, r, refit["refit_s"], rwb)
            score = s["async_step_s"] if rl.mode == "async" else s["sync_step_s"]
            if best is None or score < best[0]:
                best = (score, t, r, s)
    if best is None:
        if not divides:
            raise ValueError(f"GPU count {gpus}: no layout divides it for {m.moe.name} with batch {rl.batch} "
                             f"(TP must divide {m.heads} heads, EP {m.moe.experts} experts, DP the batch)")
        short, what, detail = closest_fail
        budget = hw.memory_GB * hw.usable_fraction
        raise ValueError(f"{m.moe.name} does not fit on {gpus} x {hw.memory_GB:g} GB ({budget:.1f} GB usable per "
                         f"GPU): {what} is short by {short:.1f} GB per GPU at the closest split: {detail}")
    _, t, r, s = best
    budget_t, budget_r = t.memory_GB["budget"], r.memory_GB["budget"]
    head_t = (budget_t - t.memory_GB["total"]) / budget_t
    one_seq = seq_bytes_per_gpu(m, r.tp, rl.seq_len) / GB
    head_r = (budget_r - r.memory_GB["weights"] - r.memory_GB["adapters"] - one_seq) / budget_r
    mem_bind = [w for w, on in (("training memory (headroom < 10%)", head_t < 0.1),
                                ("rollout memory (KV cache caps concurrency)", r.kv_bound)) if on]
    mem_bind = ", ".join(mem_bind) or "none"
    step_bind = s["async_binding"] if rl.mode == "async" else s["sync_binding"]
    steps = {"sync": 60 / s["sync_step_s"]}
    if "async_step_s" in s:
        steps["async"] = 60 / s["async_step_s"]
    return Plan(
        model=m.moe.name, gpus=gpus,
        settings={**asdict(rl), "train_weight_bytes": twb, "rollout_weight_bytes": rwb},
        hardware=hw.to_dict(),
        adapter={"layout": rl.adapter_layout, "rank": rl.rank, "params": exp_a + oth_a, "expert_params": exp_a,
                 "other_params": oth_a, "bytes": refit["bytes"], "refit_s": refit["refit_s"],
                 "attention_modules": m.attention_bytes(rl.rank),
                 "target_bytes": m.target_bytes(rl.rank, rl.adapter_layout)},
        training={"gpus": t.gpus, "tp": t.tp, "etp": t.etp, "ep": t.ep, "pp": t.pp, "dp": t.dp,
                  "microbatches_per_replica": t.microbatches, "memory_GB": t.memory_GB,
                  "memory_headroom": head_t},
        rollout={"gpus": r.gpus, "engines": r.engines, "engine_gpus": r.engine_gpus, "tp": r.tp, "ep": r.ep,
                 "attention_dp": r.engine_gpus // r.tp, "concurrency_per_engine": r.concurrency,
                 "concurrency_total": r.concurrency * r.engines, "concurrency_sync": s["concurrency_sync"],
                 "concurrency_async": s["concurrency_async"], "memory_GB": r.memory_GB,
                 "kv_bytes_per_token": m.kv_bytes_per_token, "state_bytes_per_seq": m.state_bytes_per_seq,
                 "linear_layers": m.moe.linear_layers,
                 "memory_headroom": head_r},
        rates={"production_samples_per_s": s["production_samples_per_s"],
               "consumption_samples_per_s": s["consumption_samples_per_s"],
               "production_over_consumption": s["production_samples_per_s"] / s["consumption_samples_per_s"],
               # the seed's first invariant in answer tokens: engines (async, slots full; sync, while generating)
               # against the trainer
               "produced_tokens_per_s": s["production_samples_per_s"] * s["mean_response_len"],
               "produced_tokens_per_s_sync": s["rollout_sync_samples_per_s"] * s["mean_response_len"],
               "consumed_tokens_per_s": s["consumption_samples_per_s"] * s["mean_response_len"]},
        lengths={"spec": rl.length_dist.spec, "mean": s["mean_response_len"],
                 "expected_longest_of_batch": s["longest_response_len"], "cap": rl.response_len},
        staleness={"bound": rl.staleness, "implied_max": s.get("max_staleness", 0), "ahead": s.get("ahead", 0)},
        times_s={k: s[k] for k in ("train_s", "rollout_sync_s", "produce_batch_async_s", "refit_s",
                                   "generation_s", "longest_generation_s", "sync_step_s", "async_step_s",
                                   "pipeline_bubble",
                                   "decode_step_ms_sync", "decode_step_ms_async") if k in s},
        steps_per_min=steps, max_staleness=s.get("max_staleness"),
        binding={"step": step_bind, "memory": mem_bind, "sync_step": s["sync_binding"],
                 **({"async_step": s["async_binding"]} if "async_binding" in s else {})},
    )
