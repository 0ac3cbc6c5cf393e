"""torchrun worker (4 ranks): the RL Policy at several layouts on one deterministic batch; rank 0 compares every
layout with the first and writes the numbers as JSON.

Per layout: adapters perturbed deterministically (nonzero A and B, layout independent); logprobs without replay,
recording (R2), replaying the recorded routes, replaying random routes, and without adapters; a negative-control
update replaying shuffled routes and the update in microbatches of 2 rows (each time parameters and optimizer state
restored); one update replaying the random routes with rollout correction and a KL term; the gathered gradients and
adapters after it; at the last layout a push to an in-memory engine, at the first the bad-input errors.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from moe_lora_rl.algos import PolicyLossSettings
from moe_lora_rl.lora import LoRAConfig, adapter_factors, gather_adapters
from moe_lora_rl.lora.grad_norm import adapter_grad_norm
from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.megatron.parallel import init_distributed, teardown
from moe_lora_rl.megatron.run_config import RunConfig
from moe_lora_rl.models import get_model
from moe_lora_rl.policy.core import Policy, PolicyBatch
from moe_lora_rl.router_replay.routes import RoutesBatch
from moe_lora_rl.checks.adapters import randomize_adapters
from .fakes import FakeEngine
from moe_lora_rl.checks.torchrun import finish_worker, worker_args

N, S, PROMPT = 8, 23, 5
LENGTHS = [23, 12, 17, 8, 23, 15, 6, 20]          # mixed response lengths; S=23 is odd (padded to 24 under SP)


def make_batch(vocab: int, layers: tuple[int, ...], num_experts: int, topk: int) -> tuple[PolicyBatch, RoutesBatch]:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.zeros(N, S, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = torch.randint(3, vocab, (n,), generator=g)
    t = torch.arange(S - 1)[None, :]
    lens = torch.tensor(LENGTHS)[:, None]
    mask = (t >= PROMPT - 1) & (t < lens - 1)
    adv = (torch.randn(N, 1, generator=g) + 0.3 * torch.randn(N, S - 1, generator=g)) * mask
    routes = RoutesBatch([torch.rand(n - 1, len(layers), num_experts, generator=g).argsort(-1)[..., :topk].numpy()
                          for n in LENGTHS], layers, num_experts, topk)
    batch = PolicyBatch(tokens, list(LENGTHS), mask, adv.float(), None, routes, [i // 2 for i in range(N)])
    rng = np.random.default_rng(5)
    shuffled = RoutesBatch([r[rng.permutation(r.shape[0])] for r in routes.samples], layers, num_experts, topk)
    return batch, shuffled


def rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    scale = max(float(v.abs().max()) for v in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def run_layout(path: str, key: str, rc: RunConfig, grad_clip: float, check_errors: bool, push: bool) -> dict:
    import torch.distributed as dist

    import time

    t0 = time.perf_counter()
    times = {}

    def lap(name):
        times[name] = round(time.perf_counter() - t0, 2)

    layout = Layout.parse(key)
    init_distributed(layout, rc)
    pol = Policy(path, layout, rc, LoRAConfig(rank=4, alpha=8.0), lr=1e-3, weight_decay=0.01, grad_clip=grad_clip,
                 loss=PolicyLossSettings(), micro_batch_size=1, temperature=0.9)
    randomize_adapters(pol.model, seed=7, b_scale=0.05)
    lap("build")
    arch = pol.arch
    batch, shuffled = make_batch(arch.vocab_size, tuple(arch.moe_layer_ids), arch.num_experts, arch.topk)
    out: dict = {}
    off = pol.logprobs(batch, replay="off")
    rec = pol.logprobs(batch, replay="record")
    own = pol.logprobs(dataclasses.replace(batch, routes=rec.recorded), replay="r3")
    rnd = pol.logprobs(batch, replay="r3")
    ref = pol.logprobs(batch, replay="r3", adapter=False)
    lap("logprobs")
    out["recorded"] = rec.recorded.samples
    out["own_disagreement"] = own.disagreement
    out["own_vs_off"] = float((own.logprobs - off.logprobs).abs().max())
    out["off_vs_record"] = float((rec.logprobs - off.logprobs).abs().max())
    out["random_disagreement"] = rnd.disagreement
    out["own_token_disagreement"], out["random_token_disagreement"] = own.token_disagreement, rnd.token_disagreement
    out["random_vs_off"] = float((rnd.logprobs - off.logprobs).abs().max())
    out["ref_vs_r3"] = float((ref.logprobs - rnd.logprobs).abs().max())
    out["logprobs"] = {"off": off.logprobs, "r3": rnd.logprobs, "ref": ref.logprobs}
    out["same_on_every_rank"] = _same_everywhere(rnd.logprobs)
    # old logprobs away from the current ones (some ratios clipped), rollout logprobs a little further
    g = torch.Generator().manual_seed(99)
    old = (rnd.logprobs + 0.3 * torch.randn(N, S - 1, generator=g)) * batch.loss_mask
    batch = dataclasses.replace(batch, rollout_logprobs=(old + 0.1 * torch.randn(N, S - 1, generator=g))
                                * batch.loss_mask)
    kw = dict(ref_logprobs=ref.logprobs, kl_coef=0.05, rollout_is="token", rollout_is_threshold=2.0)
    saved = [p.detach().clone() for p in pol.params]
    ctrl = pol.update(batch, old, replay="r2", routes=shuffled, **kw)     # the R2 path, wrong routes
    out["ctrl_grads"] = gather_adapters(pol.model, grads=True)
    out["ctrl_stats"] = ctrl
    lap("ctrl_update")

    def restore(pol=pol):
        with torch.no_grad():
            for p, s in zip(pol.params, saved):
                p.copy_(s)
        pol.optimizer.state.clear()
        pol.version = 0

    restore()
    pol.micro_batch_size = 2                   # the same update in microbatches of 2 rows
    pol.update(batch, old, **kw)
    out["mbs2_grads"] = gather_adapters(pol.model, grads=True)
    pol.micro_batch_size = 1
    restore()
    before = gather_adapters(pol.model)
    stats = pol.update(batch, old, **kw)
    out["stats"] = stats
    out["stats_same_on_every_rank"] = _same_everywhere(torch.tensor([stats["loss"], stats["grad_norm"],
                                                                     float(stats["clipped"]), stats["kl"],
                                                                     stats["pg_clipfrac"]], dtype=torch.float64))
    out["grads"] = gather_adapters(pol.model, grads=True)
    out["norm_after_clip"], out["naive_norm_after_clip"] = adapter_grad_norm(pol.model), naive_norm(pol)
    after = gather_adapters(pol.model)
    out["step_moved"] = max(float((after[k] - before[k]).abs().max()) for k in after)
    out["version"] = pol.version
    lap("update")
    out["nan_on_rank0"] = nan_step(pol, batch, old, kw)
    if check_errors:
        out["errors"] = bad_inputs(pol, batch, old)
    if push:
        out["push"] = push_check(pol)
    out["times"] = times
    out["zero_grad_factors"] = [k for k, v in out["grads"].items() if float(v.abs().max()) == 0.0]
    pol.replayer.detach()
    del pol
    dist.barrier()
    teardown()
    return out


def nan_step(pol: Policy, batch: PolicyBatch, old: torch.Tensor, kw: dict) -> dict:
    """One update with a NaN gradient on rank 0's first adapter factor only: the all-reduced norm is non-finite on
    every rank, so every rank skips (policy/optimizer_step.py): adapters and AdamW state unchanged, version unchanged."""
    import math

    import torch.distributed as dist

    params, version = [p.detach().clone() for p in pol.params], pol.version
    state = [{k: v.clone() for k, v in pol.optimizer.state[p].items()} for p in pol.params]
    hook = pol.params[0].register_hook(lambda g: torch.full_like(g, float("nan"))) if dist.get_rank() == 0 else None
    try:
        stats = pol.update(batch, old, **kw)
    finally:
        if hook is not None:
            hook.remove()
    same = all(torch.equal(p, q) for p, q in zip(pol.params, params)) and all(
        s.keys() == pol.optimizer.state[p].keys() and all(torch.equal(v, pol.optimizer.state[p][k])
                                                          for k, v in s.items()) for p, s in zip(pol.params, state))
    flags = torch.tensor([float(stats["skipped"]), float(not math.isfinite(stats["grad_norm"])), float(same),
                          float(pol.version == version), float(all(p.grad is None for p in pol.params))])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)       # 1 only if it holds on every rank
    return dict(zip(("skipped", "norm_non_finite", "unchanged", "version_kept", "grads_none"),
                    (bool(f) for f in flags.tolist())))


def bad_inputs(pol: Policy, batch: PolicyBatch, old: torch.Tensor) -> dict[str, str]:
    """The ValueError message of each bad input (every rank raises the same one before any collective)."""
    r = batch.routes

    def routes_like(samples, num_experts=r.num_experts, topk=r.topk):
        return dataclasses.replace(batch, routes=RoutesBatch(samples, r.layer_ids, num_experts, topk))

    cases = {
        "replay_mode": lambda: pol.logprobs(batch, replay="r2"),
        "update_replay_mode": lambda: pol.update(batch, old, replay="record"),
        "r2_without_routes": lambda: pol.update(batch, old, replay="r2"),
        "routes_tokens": lambda: pol.logprobs(routes_like([r.samples[0][:-1]] + r.samples[1:])),
        "routes_samples": lambda: pol.logprobs(routes_like(r.samples[:-1])),
        "routes_topk": lambda: pol.logprobs(routes_like([x[..., :2] for x in r.samples], topk=2)),
        "routes_layers": lambda: pol.logprobs(dataclasses.replace(batch, routes=RoutesBatch(
            [x[:, 1:] for x in r.samples], r.layer_ids[1:], r.num_experts, r.topk))),
        "routes_missing": lambda: pol.logprobs(dataclasses.replace(batch, routes=None)),
        "dp_split": lambda: pol.logprobs(PolicyBatch(batch.tokens[:6], batch.lengths[:6], batch.loss_mask[:6],
                                                     batch.advantages[:6], None, None, batch.group_ids[:6]),
                                         replay="off"),
        "old_shape": lambda: pol.update(batch, old[:, :-1]),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    mbs, pol.micro_batch_size = pol.micro_batch_size, 3
    try:
        pol.logprobs(batch, replay="off")
        out["microbatch_split"] = "no error"
    except ValueError as e:
        out["microbatch_split"] = str(e)
    finally:
        pol.micro_batch_size = mbs
    return out


def push_check(pol: Policy) -> dict:
    """Policy.push with the transport on rank 0 only: what arrives equals the gathered adapters in PEFT form."""
    import torch.distributed as dist

    from moe_lora_rl.refit.rename import to_peft_tensors

    ref = to_peft_tensors(gather_adapters(pol.model), pol.arch)
    engine = FakeEngine(pol.arch) if dist.get_rank() == 0 else None
    res = pol.push(engine, pol.version)
    if dist.get_rank() != 0:
        return {}
    got = engine.received
    return {"exact": sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref),
            "tensors": len(got), "served": res.served, "version": res.version}


def naive_norm(pol: Policy) -> float:
    """The control for the unique-shard norm: every rank's local adapter grads summed, replicas counted again."""
    import torch.distributed as dist

    sq = sum((p.grad.double().pow(2).sum() for p in pol.params), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(sq)
    return float(sq.sqrt())


def _same_everywhere(t: torch.Tensor) -> bool:
    import torch.distributed as dist

    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def compare(res: dict, layouts: list[str]) -> dict:
    ref = res[layouts[0]]
    rep: dict = {"layouts": layouts, "per_layout": {}}
    for key in layouts:
        r = res[key]
        rec_bad = sum(int((a != b).any(-1).sum()) for a, b in zip(r["recorded"], ref["recorded"]))
        rec_tot = sum(a.shape[0] * a.shape[1] for a in ref["recorded"])
        rep["per_layout"][key] = {
            "own_disagreement": r["own_disagreement"], "own_vs_off": r["own_vs_off"],
            "off_vs_record": r["off_vs_record"],
            "random_disagreement": r["random_disagreement"], "random_vs_off": r["random_vs_off"],
            "own_token_disagreement": r["own_token_disagreement"],
            "random_token_disagreement": r["random_token_disagreement"],
            "random_token_disagreement_vs_ref": abs(r["random_token_disagreement"] - ref["random_token_disagreement"]),
            "ref_vs_r3": r["ref_vs_r3"], "logprobs_same_on_every_rank": r["same_on_every_rank"],
            "stats_same_on_every_rank": r["stats_same_on_every_rank"],
            "logprob_max_diff": {k: float((r["logprobs"][k] - ref["logprobs"][k]).abs().max())
                                 for k in r["logprobs"]},
            "logprob_rel_diff": {k: float((r["logprobs"][k] - ref["logprobs"][k]).abs().max()
                                          / ref["logprobs"][k].abs().max()) for k in r["logprobs"]},
            "recorded_mismatch": [rec_bad, rec_tot],
            "stats": r["stats"], "ctrl_stats": r["ctrl_stats"],
            "grad_norm_rel_diff": abs(r["stats"]["grad_norm"] - ref["stats"]["grad_norm"]) / ref["stats"]["grad_norm"],
            "loss_diff": abs(r["stats"]["loss"] - ref["stats"]["loss"]),
            "grad_rel_diff": rel_diff(r["grads"], ref["grads"]),
            "ctrl_grad_rel_diff": rel_diff(r["ctrl_grads"], ref["grads"]),
            "mbs2_grad_rel_diff": rel_diff(r["mbs2_grads"], ref["grads"]),
            "n_factors": len(r["grads"]), "zero_grad_factors": r["zero_grad_factors"],
            "nonzero_grad_A_and_B": [any(k.endswith(f) and float(v.abs().max()) > 0 for k, v in r["grads"].items())
                                     for f in ("lora_A", "lora_B")],
            "norm_after_clip": r["norm_after_clip"], "naive_norm_after_clip": r["naive_norm_after_clip"],
            "errors": r.get("errors"), "push": r.get("push"), "nan_on_rank0": r["nan_on_rank0"], "step_moved": r["step_moved"], "version": r["version"],
            "times": r["times"],
        }
    return rep


def main(argv=None):
    import torch.distributed as dist

    def add(ap):
        ap.add_argument("--layouts", default="tp1ep1pp1,tp2ep2,pp2ep2")
        ap.add_argument("--grad-clip", type=float, default=0.5)

    a = worker_args(argv, add)
    rc = a.rc
    path = str(get_model("glm4_moe", "tiny"))
    layouts = a.layouts.split(",")
    res = {}
    for key in layouts:
        out = run_layout(path, key, rc, a.grad_clip, check_errors=key == layouts[0], push=key == layouts[-1])
        if dist.get_rank() == 0:
            res[key] = out
    finish_worker(compare(res, layouts) if dist.get_rank() == 0 else {}, a.result)


if __name__ == "__main__":
    main()
