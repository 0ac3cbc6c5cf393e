"""One trainer step on a batch of whole groups, the same in both loops (every rank): GRPO advantages, the replayed
logprob pass (the proximal policy: the trainer before the update, R3 routes of whichever version produced each
token), the optional reference pass, the update (decoupled PPO: clip on policy / proximal, rollout correction on
proximal / behaviour, behaviour being the engine's per-token logprobs) and the mismatch diagnostics.

    metrics, skipped, proximal = train_on(policy, cfg, batch)   # batch = policy_batch(samples, rewards, ...)

PPO mini-batches (algo.mini_batches, algo.epochs; verl's ppo_mini_batch_size, ppo_epochs): the proximal logprobs
are computed once, on the whole batch, before the first update; then, epoch after epoch, one update per mini-batch
(rl/minibatch.py: contiguous slices in order), each on its rows with their old logprobs (the clip is on policy /
that proximal), their R3 routes (or, with r2, their rows of the routes recorded in the proximal pass) and their
reference logprobs, so the adapter version advances once per optimizer step taken. Each mini-step's loss is
normalised by its mini-batch (as verl's engines do) and its rollout correction is computed on its rows: per token
or per sequence that is the whole batch's, rollout_is=sparse normalises its weights over the mini-batch. With one
mini-batch and one epoch the update gets the batch itself (the single-step path, unchanged). With R3 and a per-token
or per-sequence (or no) rollout correction, the first mini-batch's proximal logprobs are its own update's forward
(as the single step's): the pass before the first update covers the other mini-batches' rows only, and the two
are put together into the batch's proximal logprobs and router disagreement (weighted by routed tokens).
"""
from __future__ import annotations

import math

import torch

from .diagnostics import step_diagnostics
from .minibatch import mini_batch_rows, select, select_routes


def train_on(policy, cfg, batch, *, free_routing: bool = True, fuse: bool = True) -> tuple[dict, bool, torch.Tensor]:
    """The step's metrics, whether it was skipped (every optimizer step of it skipped), and the proximal logprobs it
    used. "ministep0_rollout_kl" / "ministep_last_rollout_kl": the k3 between the engine's logprobs and the first /
    last update forward's (Policy.update's update_rollout_kl; with rollout logprobs only): the first is the
    engine-vs-trainer mismatch of the policy that sampled, the last includes how far the mini-steps moved it.
    free_routing: run the recompute without replay (with replay=r3 a diagnostic only: the no_r3_* and free_*
    figures). fuse: with replay=r3, one mini-batch and one epoch and a per-token/sequence (or no) rollout
    correction, the proximal logprobs come from the update's own forward (Policy.update with old_logprobs=None: the
    same numbers as a separate pass, one forward fewer), and with mini-batches the first mini-batch's (the
    module's docstring); False: the separate pass over the whole batch."""
    a = cfg.algo
    single = a.mini_batches == 1 and a.epochs == 1
    own_fwd = fuse and cfg.replay == "r3" and a.rollout_is in ("token", "sequence", "off")
    fused, split = own_fwd and single, own_fwd and not single
    minis = mini_batch_rows(batch.num_rows, a.mini_batches)
    rest = [r for rows in minis[1:] for r in rows]
    replayed = None if fused or (split and not rest) else \
        policy.logprobs(select(batch, rest) if split else batch, replay="r3")   # R3: the rollout's routes
    unreplayed = policy.logprobs(batch, replay="record") \
        if free_routing or cfg.replay != "r3" else None                      # the trainer's own routing, recorded
    ref = policy.logprobs(batch, replay="r3" if cfg.replay == "r3" else "off", adapter=False).logprobs \
        if a.kl_coef > 0 else None
    kw = dict(replay="off" if cfg.replay == "off" else "r3", kl_coef=a.kl_coef,
              rollout_is=None if a.rollout_is == "off" else a.rollout_is,
              rollout_is_threshold=a.rollout_is_threshold, sparse=a.sparse_settings())
    routes = unreplayed.recorded if cfg.replay == "r2" else None
    old = None if fused or split else (replayed if cfg.replay == "r3" else unreplayed).logprobs
    if single:
        own: list = []
        upd = policy.update(batch, old, routes=routes, ref_logprobs=ref, proximal_out=own if fused else None, **kw)
        if fused:
            replayed = own[0]
        skipped = upd.pop("skipped")        # a non-finite grad norm: no step, the version unchanged
        if "update_rollout_kl" in upd:
            upd["ministep0_rollout_kl"] = upd["ministep_last_rollout_kl"] = upd["update_rollout_kl"]
    else:
        steps = []
        for epoch in range(a.epochs):
            for j, rows in enumerate(minis):
                first = split and epoch == 0 and j == 0
                own: list = []
                steps.append(policy.update(select(batch, rows), None if first else old[rows],
                                           routes=select_routes(routes, rows),
                                           ref_logprobs=None if ref is None else ref[rows],
                                           proximal_out=own if first else None, **kw))
                if first:                          # the proximal of every row, before the second mini-step
                    replayed = joined(batch, [(rows, own[0])] + ([(rest, replayed)] if rest else []))
                    old = replayed.logprobs
        upd = mini_step_metrics(steps)
        skipped = upd.pop("skipped")
    proximal = replayed.logprobs if fused or split else old
    diag = step_diagnostics(batch.rollout_logprobs, batch.loss_mask,
                            replayed=None if replayed is None else replayed.logprobs,
                            unreplayed=None if unreplayed is None else unreplayed.logprobs,
                            disagreement=None if replayed is None else replayed.disagreement,
                            token_disagreement=None if replayed is None else replayed.token_disagreement,
                            free_routes=None if unreplayed is None else unreplayed.recorded,
                            rollout_routes=batch.routes)
    return {**upd, **diag}, skipped, proximal


def joined(batch, parts):
    """One LogprobResult of the batch from (rows, LogprobResult of those rows) parts that cover it: the logprobs
    row by row; the router disagreement figures weighted by each part's routed tokens (a sample's length - 1)."""
    from ..policy.batch import LogprobResult

    lp = torch.zeros(batch.num_rows, batch.seq_len - 1, dtype=torch.float32)
    for rows, res in parts:
        lp[rows] = res.logprobs
    w = [float(sum(batch.lengths[i] - 1 for i in rows)) for rows, _ in parts]
    total = sum(w)
    dis, tok = None, None
    if all(res.disagreement is not None for _, res in parts):
        layers = sorted({k for _, res in parts for k in res.disagreement})
        dis = {k: sum(wi * res.disagreement.get(k, 0.0) for wi, (_, res) in zip(w, parts)) / total for k in layers}
    if all(res.token_disagreement is not None for _, res in parts):
        tok = sum(wi * res.token_disagreement for wi, (_, res) in zip(w, parts)) / total
    return LogprobResult(lp, dis, None, tok)


def mini_step_metrics(steps: list[dict]) -> dict:
    """One rollout batch's metrics from its mini-steps' Policy.update results: each number the mean over the
    mini-steps that stepped (over all of them if none did, as a skipped single step reports), a flag true if any
    mini-step's was; and mini_steps, mini_steps_skipped, pg_clipfrac_last, grad_norm_max (over the steps taken),
    ministep0_rollout_kl / ministep_last_rollout_kl; "skipped" only if every mini-step skipped."""
    taken = [s for s in steps if not s["skipped"]] or steps
    out: dict = {}
    for k in dict.fromkeys(k for s in steps for k in s):       # every key, in first-seen order
        if k == "skipped":
            continue
        vals = [s[k] for s in taken if k in s]
        if any(isinstance(s.get(k), bool) for s in steps):
            out[k] = any(s.get(k, False) for s in steps)
        elif vals:
            out[k] = sum(vals) / len(vals)
    norms = [s["grad_norm"] for s in taken if math.isfinite(s["grad_norm"])]
    out.update(mini_steps=len(steps), mini_steps_skipped=sum(bool(s["skipped"]) for s in steps),
               pg_clipfrac_last=steps[-1]["pg_clipfrac"], grad_norm_max=max(norms) if norms else float("nan"),
               skipped=all(s["skipped"] for s in steps))
    if "update_rollout_kl" in steps[0]:
        out["ministep0_rollout_kl"] = steps[0]["update_rollout_kl"]
    if "update_rollout_kl" in steps[-1]:
        out["ministep_last_rollout_kl"] = steps[-1]["update_rollout_kl"]
    return out


def effective_sample_size(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> float:
    """Normalised effective sample size of the token importance weights w = pi_proximal / pi_behaviour over the
    masked tokens: (sum w)^2 / (n sum w^2), 1 when the data is on-policy, towards 1/n as it goes off."""
    w = torch.exp((proximal.double() - behaviour.double())[mask])
    if w.numel() == 0:
        raise ValueError("no token to weigh")
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))
