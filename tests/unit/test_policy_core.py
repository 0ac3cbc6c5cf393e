"""The training core (policy/training.py) through both of its drivers, in one process (world size 1, gloo, tiny
GLM4-MoE): the main job's Policy.update and verl's MoELoRAEngine.train_batch (our engine behind verl's contract,
with verl's ppo_loss).

- The non-finite rule (policy/optimizer_step.py): a NaN injected into one adapter factor's gradient (a tensor hook, the same
  factor in both models) skips the step identically in both drivers: adapters and AdamW state bitwise unchanged,
  version unchanged, grads None, the norm returned non-finite, the step reported skipped. Control: the same call
  without the NaN moves the adapters, fills the optimizer state and advances the version.
- The replayer is left empty after an engine step with R3 routes, also when the step fails between microbatches
  (a loss function raising on the second microbatch): queue, recompute_queue, measure_queue, recorded and disagree
  of every router, mode DISABLED. Control: at the failure the queues did hold the later microbatches' routes.
- Masked importance sampling (Policy.update rollout_is="mis"): rollout logprobs pushed outside the [1/2, 2] ratio
  band for some tokens (others moved inside it, off ratio 1) give exactly the update of rollout_is=None with those
  tokens taken out of loss_mask: loss, grad norm, clip fraction, every adapter gradient and the adapters after the
  step (the same float ops on the same inputs: compared bitwise). Controls: truncated IS ("token") on the same
  logprobs gives another loss; a wide band (threshold 1e3) rejects nothing and equals rollout_is=None on the full
  mask. Every token rejected: the step is skipped (adapters, optimizer state, version unchanged).
"""
import copy
import dataclasses
import math
import os
from functools import partial

import pytest
import torch

pytest.importorskip("verl")

LORA = {"rank": 4, "alpha": 8, "adapter_layout": "per_expert"}


@pytest.fixture(scope="module")
def verl_cpu_platform():
    """verl on our CPU platform for this module only: the environment and verl's cached platform are restored after,
    so later tests (and the subprocesses they start) see verl as before."""
    from verl.plugin.platform import platform_manager

    from moe_lora_rl.checks.verl_worker import VERL_CPU_ENV

    saved_env = {k: os.environ.get(k) for k in VERL_CPU_ENV}
    saved_platform = platform_manager._current_platform
    os.environ.update(VERL_CPU_ENV)
    yield
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    platform_manager._current_platform = saved_platform


@pytest.fixture(scope="module")
def drivers(verl_cpu_platform):
    from verl.workers.config import EngineRouterReplayConfig, HFModelConfig
    from verl.workers.config.optimizer import OptimizerConfig

    from moe_lora_rl.algos import PolicyLossSettings
    from moe_lora_rl.integration.verl import plugin
    from moe_lora_rl.integration.verl.verl_config import MoELoRAEngineConfig, lora_config
    from moe_lora_rl.integration.verl.engine import MoELoRAEngine
    from moe_lora_rl.megatron.layout import Layout
    from moe_lora_rl.megatron.parallel import teardown
    from moe_lora_rl.megatron.run_config import RunConfig
    from moe_lora_rl.models import get_model
    from moe_lora_rl.policy.core import Policy
    from megatron.core import parallel_state as ps

    shared_world = ps.model_parallel_is_initialized()  # another module's single-rank world (conftest's qwen)
    plugin.register()                                 # verl's CPU platform (idempotent)
    path = str(get_model("glm4_moe", "tiny"))
    ec = MoELoRAEngineConfig(dtype="float32", device="cpu", router_replay=EngineRouterReplayConfig(mode="R3"),
                             use_dynamic_bsz=False, micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2)
    eng = MoELoRAEngine(HFModelConfig(path=path, lora=dict(LORA)), ec,
                        optimizer_config=OptimizerConfig(lr=1e-3, clip_grad=1.0))
    eng.initialize()                                  # init_distributed(tp1ep1pp1) for both drivers
    pol = Policy(path, Layout(), RunConfig(device="cpu", dtype="fp32"), lora_config(LORA), lr=1e-3,
                 weight_decay=0.01, grad_clip=1.0, loss=PolicyLossSettings(), micro_batch_size=2, temperature=0.7)
    for core in (eng.core, pol.core):                 # nonzero B: every factor gets a gradient
        with torch.no_grad():
            for p in core.params:
                p.add_(0.01)
    yield pol, eng
    teardown()
    if shared_world:                                  # leave the single-rank world as it was found
        from moe_lora_rl.megatron.parallel import init_distributed

        init_distributed(Layout(), RunConfig())


def _policy_call(pol):
    from kit.policy_update_worker import make_batch

    arch = pol.arch
    batch, _ = make_batch(arch.vocab_size, tuple(arch.moe_layer_ids), arch.num_experts, arch.topk)
    old = pol.logprobs(batch, replay="off").logprobs

    def call():
        u = pol.update(batch, old, replay="r3", rollout_is=None)
        return u["grad_norm"], u["skipped"]
    return call


def _verl_data(eng, routes: bool):
    from verl.utils import tensordict_utils as tu

    from moe_lora_rl.algos import grpo_advantages
    from moe_lora_rl.checks.verl_worker import GROUP, N, make_batch, verl_batch

    b = make_batch(eng.arch)
    adv = grpo_advantages(b["rewards"], b["resp_mask"], [i // GROUP for i in range(N)])
    td = verl_batch(b, (b["noise"] - 3.0) * b["resp_mask"], adv, list(range(N)), routes=routes)
    tu.assign_non_tensor(td, use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         max_token_len_per_gpu=None, use_fused_kernels=False, enable_routing_replay=routes)
    return td


def _ppo_loss():
    from verl.workers.utils.losses import ppo_loss

    from moe_lora_rl.algos import PolicyLossSettings, actor_config

    return partial(ppo_loss, actor_config(PolicyLossSettings()))


def _engine_call(eng, loss_fn=None, routes=False):
    def call():
        with eng.train_mode():
            out = eng.train_batch(_verl_data(eng, routes), loss_function=loss_fn or _ppo_loss())
        return out["metrics"]["grad_norm"], eng.core.last_step.skipped
    return call


def _state(opt):
    return {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in enumerate(opt.state[p] for p in opt.param_groups[0]["params"]) if s}


def _same_state(a, b):
    return a.keys() == b.keys() and all(a[i].keys() == b[i].keys() and all(
        torch.equal(a[i][k], b[i][k]) if isinstance(a[i][k], torch.Tensor) else a[i][k] == b[i][k] for k in a[i])
        for i in a)


def _outcome(core, call, nan: bool) -> dict:
    before, state, version = [p.detach().clone() for p in core.params], _state(core.optimizer), core.version
    names = [n for n, _ in __import__("moe_lora_rl.lora", fromlist=["adapter_factors"]).adapter_factors(core.model)]
    target = core.params[next(i for i, n in enumerate(names) if "linear_qkv" in n)]     # a dense factor: always used
    hook = target.register_hook(lambda g: torch.full_like(g, float("nan"))) if nan else None
    try:
        norm, skipped = call()
    finally:
        if hook is not None:
            hook.remove()
    return {"adapters_max_change": max(float((p.detach() - q).abs().max()) for p, q in zip(core.params, before)),
            "optimizer_state_unchanged": _same_state(_state(core.optimizer), state) and bool(state),
            "version_delta": core.version - version, "grads_none": all(p.grad is None for p in core.params),
            "norm_finite": math.isfinite(norm), "skipped": skipped}


def test_non_finite_grad_norm_skips_the_step_in_both_drivers(drivers):
    pol, eng = drivers
    calls = {"policy": (pol.core, _policy_call(pol)), "verl": (eng.core, _engine_call(eng))}
    control = {k: _outcome(core, call, nan=False) for k, (core, call) in calls.items()}
    for k, c in control.items():                      # finite grads: a real step (fills the AdamW state too)
        assert c["adapters_max_change"] > 1e-5 and c["version_delta"] == 1 and c["norm_finite"], (k, c)
        assert not c["skipped"] and not c["grads_none"] and not c["optimizer_state_unchanged"], (k, c)
    got = {k: _outcome(core, call, nan=True) for k, (core, call) in calls.items()}
    want = {"adapters_max_change": 0.0, "optimizer_state_unchanged": True, "version_delta": 0, "grads_none": True,
            "norm_finite": False, "skipped": True}
    assert got == {"policy": want, "verl": want}, got
    after = {k: _outcome(core, call, nan=False) for k, (core, call) in calls.items()}
    for k, c in after.items():                        # training goes on after a skip
        assert c["version_delta"] == 1 and c["adapters_max_change"] > 1e-5 and not c["skipped"], (k, c)


def _leftovers(replayer) -> dict:
    return {r.layer: (len(r.queue), len(r.recompute_queue), len(r.measure_queue), len(r.recorded), r.disagree,
                      len(r.token_flags), r.mode.value) for r in replayer.replays}


def test_replayer_is_empty_after_an_engine_step(drivers):
    _, eng = drivers
    empty = {r.layer: (0, 0, 0, 0, [0, 0], 0, "disabled") for r in eng.replayer.replays}
    assert sorted(empty) == [1, 2, 3]
    _engine_call(eng, routes=True)()
    assert _leftovers(eng.replayer) == empty
    seen = {}
    base = _ppo_loss()

    def failing_loss(model_output, data, dp_group=None):
        seen["calls"] = seen.get("calls", 0) + 1
        if seen["calls"] == 2:                        # the second microbatch: the later ones are still queued
            seen["at_failure"] = _leftovers(eng.replayer)
            raise RuntimeError("loss failed on microbatch 2")
        return base(model_output=model_output, data=data, dp_group=dp_group)

    with pytest.raises(RuntimeError, match="loss failed on microbatch 2"):
        _engine_call(eng, loss_fn=failing_loss, routes=True)()
    assert all(q == 2 and m == 2 and mode == "replay" for q, _, m, _, _, _, mode in seen["at_failure"].values()), seen
    assert _leftovers(eng.replayer) == empty
    grad_norm, skipped = _engine_call(eng, routes=True)()          # the next step replays cleanly
    assert math.isfinite(grad_norm) and not skipped and _leftovers(eng.replayer) == empty


def _snapshot(core):
    return [p.detach().clone() for p in core.params], copy.deepcopy(core.optimizer.state_dict()), core.version


def _restore(core, snap):
    params, opt, version = snap
    with torch.no_grad():
        for p, q in zip(core.params, params):
            p.copy_(q)
    core.optimizer.load_state_dict(copy.deepcopy(opt))     # deep copy: the step updates the state in place
    core.version = version


def _update(pol, batch, old, snap, **kw):
    """One update from the snapshot: (returned stats, grads, adapters after); the snapshot restored after."""
    _restore(pol.core, snap)
    u = pol.update(batch, old, replay="r3", **kw)
    out = u, [p.grad.clone() for p in pol.core.params], [p.detach().clone() for p in pol.core.params]
    _restore(pol.core, snap)
    return out


def test_mis_rejection_is_masking_the_tokens_out(drivers):
    from kit.policy_update_worker import make_batch

    pol, _ = drivers
    arch = pol.arch
    batch, _ = make_batch(arch.vocab_size, tuple(arch.moe_layer_ids), arch.num_experts, arch.topk)
    old = pol.logprobs(batch, replay="off").logprobs
    mask = batch.loss_mask
    g = torch.Generator().manual_seed(0)
    u = torch.rand(mask.shape, generator=g)
    sign = torch.where(torch.rand(mask.shape, generator=g) < 0.5, 1.0, -1.0)
    out = mask & (u < 0.25)                                   # log ratio +-1: ratio e or 1/e, rejected
    inside = mask & (u >= 0.25) & (u < 0.6)                   # log ratio +-0.4: ratio 1.49 or 0.67, kept at weight 1
    log_ratio = sign * (1.0 * out + 0.4 * inside)
    rollout = (old - log_ratio) * mask                        # the batch's convention: 0 outside loss_mask
    assert 0 < int(out.sum()) < int(mask.sum()) and int(inside.sum()) > 0
    snap = _snapshot(pol.core)
    mis = _update(pol, dataclasses.replace(batch, rollout_logprobs=rollout), old, snap, rollout_is="mis")
    ctrl = _update(pol, dataclasses.replace(batch, loss_mask=mask & ~out), old, snap, rollout_is=None)
    assert mis[0]["rollout_rejected_frac"] == int(out.sum()) / int(mask.sum()) and not mis[0]["skipped"]
    assert ctrl[0]["rollout_rejected_frac"] == 0.0
    for k in ("loss", "grad_norm", "pg_clipfrac", "kl", "clipped"):
        assert mis[0][k] == ctrl[0][k], (k, mis[0][k], ctrl[0][k])
    assert all(torch.equal(a, b) for a, b in zip(mis[1], ctrl[1])) and any(bool(a.any()) for a in mis[1])
    assert all(torch.equal(a, b) for a, b in zip(mis[2], ctrl[2]))
    # controls: TIS reweights instead (another loss); a wide band rejects nothing and is no correction at all
    tis = _update(pol, dataclasses.replace(batch, rollout_logprobs=rollout), old, snap, rollout_is="token")
    assert abs(tis[0]["loss"] - mis[0]["loss"]) > 1e-4 and tis[0]["rollout_rejected_frac"] == 0.0
    wide = _update(pol, dataclasses.replace(batch, rollout_logprobs=rollout), old, snap, rollout_is="mis",
                   rollout_is_threshold=1e3)
    plain = _update(pol, batch, old, snap, rollout_is=None)
    assert wide[0]["rollout_rejected_frac"] == 0.0 and wide[0]["loss"] == plain[0]["loss"] != mis[0]["loss"]
    assert all(torch.equal(a, b) for a, b in zip(wide[1], plain[1]))
    # every token rejected: skipped, nothing moves
    gone = dataclasses.replace(batch, rollout_logprobs=(old - 2.0) * mask)
    before, state = [p.detach().clone() for p in pol.core.params], _state(pol.core.optimizer)
    u = pol.update(gone, old, replay="r3", rollout_is="mis")
    assert u["skipped"] and u["rollout_rejected_frac"] == 1.0 and pol.core.version == snap[2]
    assert all(torch.equal(p, q) for p, q in zip(pol.core.params, before))
    assert _same_state(_state(pol.core.optimizer), state)


def _padded(batch, old, extra: int):
    """The same rows right-padded by `extra` more positions (what a longer prompt or response elsewhere in the
    batch does to the tensor width); routes are per real token, so they stay."""
    from moe_lora_rl.policy.batch import PolicyBatch

    def pad(t, value):
        return torch.cat([t, t.new_full((t.shape[0], extra), value)], dim=1)
    return (PolicyBatch(pad(batch.tokens, 0), list(batch.lengths), pad(batch.loss_mask, False),
                        pad(batch.advantages, 0.0), None, batch.routes, list(batch.group_ids)), pad(old, 0.0))


def _alone(batch, old, rows):
    """The mini-batch of `rows` built on its own: only those rows, padded to their own longest."""
    from moe_lora_rl.policy.batch import PolicyBatch
    from moe_lora_rl.router_replay.routes import RoutesBatch

    w = max(batch.lengths[i] for i in rows)
    r = batch.routes
    return (PolicyBatch(batch.tokens[rows, :w], [batch.lengths[i] for i in rows], batch.loss_mask[rows, :w - 1],
                        batch.advantages[rows, :w - 1], None,
                        RoutesBatch([r.samples[i] for i in rows], r.layer_ids, r.num_experts, r.topk),
                        [batch.group_ids[i] for i in rows]), old[rows, :w - 1])


def _rel(a, b) -> float:
    scale = max(float(x.abs().max()) for x in b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / scale


def test_gradient_is_invariant_to_padding_microbatches_dp_and_minibatches_in_every_agg_mode(drivers, monkeypatch):
    """Every loss_agg_mode, with the run's settings as the main job makes them (AlgoSettings.policy_loss_settings):
    the gradient of one global batch is the same (checks/tolerances.py GRAD_SPLIT relative: fp32's floor) padded to two widths, in 1 vs 4 micro-batches,
    and on 1 vs 2 data-parallel ranks (each rank's share through Policy._plan, the ranks' gradients summed as
    lora.grad_sync sums them); a mini-step's gradient (rl/minibatch.select: the whole batch's width) equals its
    mini-batch's built alone (its own width). seq-mean-token-sum-norm divides by a constant of the run
    (algo.max_response_tokens, verl's loss_scale_factor), not by the padded width. Control: verl's default (no
    loss_scale_factor) moves with the padding."""
    import megatron.core.parallel_state as ps

    from moe_lora_rl.algos import LOSS_AGG_MODES, PolicyLossSettings
    from kit.policy_update_worker import make_batch
    from moe_lora_rl.checks.tolerances import GRAD_SPLIT
    from moe_lora_rl.rl.config import AlgoSettings
    from moe_lora_rl.rl.minibatch import select

    pol, _ = drivers
    arch = pol.arch
    batch, _ = make_batch(arch.vocab_size, tuple(arch.moe_layer_ids), arch.num_experts, arch.topk)
    old = pol.logprobs(batch, replay="r3").logprobs - 0.05 * batch.loss_mask   # ratio != 1: the clip is in play
    snap = _snapshot(pol.core)
    saved = pol.loss, pol.grad_clip, pol.micro_batch_size
    pol.grad_clip = 1e9                                     # no clipping: the gradients themselves are compared

    def grads(b, o, mbs=2, dp=None):
        pol.micro_batch_size = mbs
        if dp is None:
            return _update(pol, b, o, snap, rollout_is=None)[1]
        total = None
        for r in range(dp):
            monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda *a, **k: dp)
            monkeypatch.setattr(ps, "get_data_parallel_rank", lambda *a, r=r, **k: r)
            g = _update(pol, b, o, snap, rollout_is=None)[1]
            monkeypatch.undo()
            total = g if total is None else [x + y for x, y in zip(total, g)]
        return total

    try:
        worst = {}
        for mode in LOSS_AGG_MODES:
            pol.loss = AlgoSettings(loss_agg_mode=mode, max_response_tokens=20).policy_loss_settings()
            ref = grads(batch, old)
            rows = [1, 2, 3, 6]                              # lengths 12, 17, 8, 6: alone, width 17 (not 23)
            worst[mode] = {"pad9": _rel(grads(*_padded(batch, old, 9)), ref),
                           "pad30": _rel(grads(*_padded(batch, old, 30)), ref),
                           "mbs1_vs_4": _rel(grads(batch, old, mbs=1), grads(batch, old, mbs=4)),
                           "dp2": _rel(grads(batch, old, dp=2), ref),
                           "mini_step": _rel(grads(select(batch, rows), old[rows]), grads(*_alone(batch, old, rows)))}
        print("GRAD_SPLIT", worst)
        assert all(v <= GRAD_SPLIT for d in worst.values() for v in d.values()), worst
        pol.loss = PolicyLossSettings(loss_agg_mode="token-mean")        # control: the width-normalised default
        object.__setattr__(pol.loss, "loss_agg_mode", "seq-mean-token-sum-norm")   # bypass the refusal on purpose
        control = _rel(grads(*_padded(batch, old, 9)), grads(batch, old))
        print("GRAD_SPLIT control", control)
        assert control > 0.1
    finally:
        pol.loss, pol.grad_clip, pol.micro_batch_size = saved
        _restore(pol.core, snap)
