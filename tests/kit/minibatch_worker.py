"""torchrun worker (2 ranks, ep2: dp 2, the experts split): PPO mini-batches through rl/trainer_step.py's train_on on the tiny
GLM4-MoE, each case from the same adapters and a fresh AdamW (restored between cases); rank 0 writes JSON.

  single      mini_batches=1, epochs=1 through train_on vs today's path by hand (the replayed and the recorded
              logprob passes, then ONE Policy.update on the batch itself): adapters and metrics bit for bit
  mini4       mini_batches=4 (2 rows each: one per data-parallel rank) vs 4 Policy.update calls by hand on row slices
              built here (not with rl/minibatch.py), each with the proximal recompute of the whole batch as its old
              logprobs; controls: the same slices in reverse order, and the single update, give other adapters.
              train_on takes the first mini-batch's proximal from its own update forward: its router disagreement,
              put together from the two passes, against one pass over the whole batch, and the whole step against
              train_on(fuse=False) (the separate pass)
  epochs2     mini_batches=4, epochs=2: 8 optimizer steps, the version +8
  grouped     the same replayed logprobs and one update on the legacy GroupedMLP (runtime.experts=grouped) from the
              same adapters; control: the grouped model with the routes shuffled over tokens
  rollout_kl  rollout logprobs = the replayed recompute itself (the engine is not needed for this check: with R3 in
              fp32 the update forward must reproduce it), so ministep0_rollout_kl is ~0; the control replays the
              routes shuffled over tokens in the update (the batch's routes shuffled), and the k3 is far off
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import torch

from moe_lora_rl.algos import PolicyLossSettings, SparseCorrection
from moe_lora_rl.lora import LoRAConfig, adapter_factors, gather_adapters
from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.megatron.parallel import init_distributed, teardown
from moe_lora_rl.policy.core import Policy, PolicyBatch
from moe_lora_rl.router_replay.routes import RoutesBatch
from moe_lora_rl.checks.adapters import randomize_adapters
from moe_lora_rl.checks.torchrun import finish_worker, worker_args

N, S, PROMPT, GROUP = 8, 19, 5, 2
LENGTHS = [19, 12, 17, 8, 19, 15, 9, 16]
LR = 2e-2                      # large enough that later mini-steps leave the clip range of the proximal policy


def make_batch(arch) -> tuple[PolicyBatch, RoutesBatch]:
    g = torch.Generator().manual_seed(4321)
    layers, e, k = tuple(arch.moe_layer_ids), arch.num_experts, arch.topk
    tokens = torch.zeros(N, S, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = torch.randint(3, arch.vocab_size, (n,), generator=g)
    t = torch.arange(S - 1)[None, :]
    mask = (t >= PROMPT - 1) & (t < torch.tensor(LENGTHS)[:, None] - 1)
    adv = (torch.randn(N, 1, generator=g) + 0.3 * torch.randn(N, S - 1, generator=g)) * mask
    routes = RoutesBatch([torch.rand(n - 1, len(layers), e, generator=g).argsort(-1)[..., :k].numpy()
                          for n in LENGTHS], layers, e, k)
    rng = np.random.default_rng(5)
    shuffled = RoutesBatch([r[rng.permutation(r.shape[0])] for r in routes.samples], layers, e, k)
    batch = PolicyBatch(tokens, list(LENGTHS), mask, adv.float(), None, routes, [i // GROUP for i in range(N)])
    return batch, shuffled


def cfg(mini_batches: int, epochs: int):
    from moe_lora_rl.rl.config import AlgoSettings

    return types.SimpleNamespace(replay="r3", algo=AlgoSettings(
        group_size=GROUP, prompts_per_step=N // GROUP, micro_batch_size=1, mini_batches=mini_batches, epochs=epochs,
        lr=LR, grad_clip=1.0, rollout_is="token"))


def rows_by_hand(batch: PolicyBatch, a: int, b: int) -> PolicyBatch:
    r = batch.routes
    return PolicyBatch(batch.tokens[a:b], batch.lengths[a:b], batch.loss_mask[a:b], batch.advantages[a:b],
                       batch.rollout_logprobs[a:b], RoutesBatch(r.samples[a:b], r.layer_ids, r.num_experts, r.topk),
                       batch.group_ids[a:b])


def max_diff(x: dict, y: dict) -> float:
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def pol_full_pass(pol, batch, saved, restore) -> dict:
    """The router disagreement of one replayed pass over the whole batch from the saved adapters (as
    rl/diagnostics.py reports it: the mean over layers, and the token figure)."""
    restore()
    res = pol.logprobs(batch, replay="r3")
    return {"disagreement": sum(res.disagreement.values()) / len(res.disagreement),
            "token_disagreement": res.token_disagreement}


def main(argv=None):
    import torch.distributed as dist

    from moe_lora_rl.rl.trainer_step import train_on

    a = worker_args(argv, lambda ap: ap.add_argument("--model", required=True))
    init_distributed(Layout(ep=2), a.rc)
    pol = Policy(a.model, Layout(ep=2), a.rc, LoRAConfig(rank=4, alpha=8.0), lr=LR,
                 weight_decay=0.0, grad_clip=1.0, loss=PolicyLossSettings(), micro_batch_size=1)
    randomize_adapters(pol.model, seed=7, b_scale=0.05)
    saved = [p.detach().clone() for p in pol.params]

    def restore():
        with torch.no_grad():
            for p, s in zip(pol.params, saved):
                p.copy_(s)
        pol.optimizer.state.clear()
        pol.version = 0

    batch, shuffled = make_batch(pol.arch)
    batch = dataclasses.replace(batch, rollout_logprobs=pol.logprobs(batch, replay="r3").logprobs)
    g = torch.Generator().manual_seed(9)                   # a rollout a little off the trainer (TIS weights != 1)
    off_batch = dataclasses.replace(batch, rollout_logprobs=(batch.rollout_logprobs + 0.05 * torch.randn(
        N, S - 1, generator=g)) * batch.loss_mask)
    out: dict = {}

    # single: train_on(1, 1) vs today's path by hand
    restore()
    m1, skipped1, prox1 = train_on(pol, cfg(1, 1), off_batch)       # the proximal from the update's own forward
    single = gather_adapters(pol.model)
    out["single_version"] = pol.version
    restore()
    replayed = pol.logprobs(off_batch, replay="r3")
    pol.logprobs(off_batch, replay="record")
    today = pol.update(off_batch, replayed.logprobs, replay="r3", routes=None, ref_logprobs=None, kl_coef=0.0,
                       rollout_is="token", rollout_is_threshold=2.0, sparse=SparseCorrection())
    today_skipped = today.pop("skipped")
    out["single_bit_equal"] = all(torch.equal(single[k], v) for k, v in gather_adapters(pol.model).items())
    out["single_metrics_equal"] = {k: m1.get(k) == v for k, v in today.items()} | {"skipped": skipped1 == today_skipped}
    out["single_metrics"] = {k: v for k, v in m1.items() if isinstance(v, (int, float))}
    out["fused_proximal_equal"] = torch.equal(prox1, replayed.logprobs)
    out["fused_disagreement_equal"] = m1.get("disagreement") == sum(replayed.disagreement.values()) / len(
        replayed.disagreement) and m1.get("token_disagreement") == replayed.token_disagreement
    restore()                               # control: a proximal off by 0.01 per token moves the update
    pol.update(off_batch, replayed.logprobs + 0.01 * off_batch.loss_mask, replay="r3", rollout_is="token")
    out["single_control_equal"] = all(torch.equal(single[k], v) for k, v in gather_adapters(pol.model).items())

    # mini4: train_on(4, 1) vs 4 updates by hand on the row slices, old = the proximal recompute of the whole batch
    restore()
    m4, skipped4, proximal = train_on(pol, cfg(4, 1), off_batch)
    mini4 = gather_adapters(pol.model)
    out["mini4_version"], out["mini4_skipped"] = pol.version, skipped4
    out["mini4_metrics"] = {k: v for k, v in m4.items() if isinstance(v, (int, float))}
    slices = [(j * 2, j * 2 + 2) for j in range(4)]

    def by_hand(order):
        restore()
        old = pol.logprobs(off_batch, replay="r3").logprobs
        stats = [pol.update(rows_by_hand(off_batch, lo, hi), old[lo:hi], replay="r3", rollout_is="token")
                 for lo, hi in order]
        return gather_adapters(pol.model), stats, old

    hand, hand_stats, hand_old = by_hand(slices)
    out["mini4_vs_hand"] = max_diff(mini4, hand)
    out["proximal_vs_hand_old"] = float((proximal - hand_old).abs().max())
    full = pol_full_pass(pol, off_batch, saved, restore)
    out["mini4_disagreement_vs_full"] = max(abs(m4["disagreement"] - full["disagreement"]),
                                            abs(m4["token_disagreement"] - full["token_disagreement"]))
    out["mini4_disagreement"] = m4["disagreement"]
    restore()                                 # the separate pass over the whole batch (fuse=False): the same step
    m4_sep, _, _ = train_on(pol, cfg(4, 1), off_batch, fuse=False)
    out["mini4_vs_separate"] = max_diff(mini4, gather_adapters(pol.model))
    out["mini4_metrics_vs_separate"] = max(abs(m4[k] - m4_sep[k]) for k in ("loss", "pg_clipfrac", "grad_norm",
                                                                         "disagreement", "token_disagreement"))
    out["hand_clipfrac"] = [s["pg_clipfrac"] for s in hand_stats]
    out["hand_version"] = pol.version
    reverse, _, _ = by_hand(slices[::-1])
    out["mini4_vs_reverse"] = max_diff(mini4, reverse)
    out["mini4_vs_single"] = max_diff(mini4, single)

    # epochs2: twice the optimizer steps
    restore()
    m8, _, _ = train_on(pol, cfg(4, 2), off_batch)
    out["epochs2_version"], out["epochs2_mini_steps"] = pol.version, m8["mini_steps"]

    # rollout_kl: the rollout = the replayed recompute; control: the update replays the routes shuffled
    restore()
    mk, _, _ = train_on(pol, cfg(4, 1), batch)
    out["kl_replayed"] = {k: mk[k] for k in ("ministep0_rollout_kl", "ministep_last_rollout_kl")}
    restore()
    mc, _, _ = train_on(pol, cfg(4, 1), dataclasses.replace(batch, routes=shuffled))
    out["kl_shuffled"] = {k: mc[k] for k in ("ministep0_rollout_kl", "ministep_last_rollout_kl")}

    # grouped: the same update on the legacy GroupedMLP (runtime.experts=grouped), from the same adapters
    restore()
    pol_g = Policy(a.model, Layout(ep=2), dataclasses.replace(a.rc, grouped_experts=True),
                   LoRAConfig(rank=4, alpha=8.0), lr=LR, weight_decay=0.0, grad_clip=1.0, loss=PolicyLossSettings(),
                   micro_batch_size=1)
    mine = {p.lora_meta.global_name: p for _, p in adapter_factors(pol.model)}
    with torch.no_grad():
        for _, p in adapter_factors(pol_g.model):         # the same factors, listed in another order
            p.copy_(mine[p.lora_meta.global_name])
    out["grouped_class"] = sorted({type(m).__name__ for m in pol_g.model.modules() if "MLP" in type(m).__name__})
    lp_s, lp_g = (p.logprobs(off_batch, replay="r3").logprobs for p in (pol, pol_g))
    out["grouped_logprobs_diff"] = float((lp_s - lp_g).abs().max())
    out["grouped_shuffled_diff"] = float((pol_g.logprobs(dataclasses.replace(off_batch, routes=shuffled),
                                                         replay="r3").logprobs - lp_s).abs().max())
    train_on(pol, cfg(1, 1), off_batch)
    train_on(pol_g, cfg(1, 1), off_batch)
    out["grouped_update_diff"] = max_diff(gather_adapters(pol.model), gather_adapters(pol_g.model))
    pol_g.replayer.detach()

    pol.replayer.detach()
    teardown()
    finish_worker(out if dist.get_rank() == 0 else {}, a.result)


if __name__ == "__main__":
    main()
