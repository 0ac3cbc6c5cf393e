"""torchrun worker: our engine driven through verl's real TrainingWorker at each layout, against a tp1ep1pp1
reference computed without our engine (build_from_hf + forward_logits + verl's policy losses via algos).

Per layout, on one global batch (GRPO advantages, perturbed old log-probs, temperature 0.7):
  logprobs            TrainingWorker.infer_batch vs the reference's label log-probs
  base                infer_batch with no_lora_adapter (verl's reference-policy flag) vs the model without adapters
  loss_vanilla        TrainingWorker.train_batch (verl's ppo_loss: vanilla, token-mean) vs verl's loss on the reference
  grad_norm           the engine's global adapter grad norm vs the reference's
  loss_gspo           infer_batch with compute_loss (gspo, seq-mean-token-sum) vs the reference
  checkpoint          verl's save_checkpoint / load_checkpoint: adapters + AdamW state, the next step replayed exactly
  mini-batches        TrainingWorker.train_mini_batch (verl's update_actor) with 2 mini-batches x 2 epochs: optimizer
                      steps, the adapters vs train_batch by hand per mini-batch, the first mini-step's loss vs verl's
                      loss over its rows (minibatch_check, from the initial adapters, state restored after)
  r3                  verl-format routed_experts (int16 [N, P+R, all layers, k], left-padding aligned) replayed by the
                      engine vs our RoutesBatch replayed in the reference; and the reference without replay (control)
Rank 0 writes the max abs differences as JSON.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .adapters import randomize_adapters
from .verl_data import (GROUP, MICRO, N, TEMPERATURE, make_batch, real_tokens, response_entropy,  # noqa: F401
                        response_logprobs, response_logprobs_autograd, verl_batch)
from .torchrun import finish_worker, worker_args
from .verl_stream import stream_check

VERL_CPU_ENV = {"VERL_PLATFORM": "moe_lora_cpu", "VERL_ENGINE_DEVICE": "cpu"}   # set by main(), never at import

LORA = {"rank": 4, "alpha": 8, "adapter_layout": "per_expert"}
LOSSES = {"vanilla": ("vanilla", "token-mean"), "gspo": ("gspo", "seq-mean-token-sum")}


def settings(mode):
    from ..algos import PolicyLossSettings

    loss_mode, agg = LOSSES[mode]
    return PolicyLossSettings(loss_mode=loss_mode, loss_agg_mode=agg)


def reference(path, arch, b, adv) -> dict:
    """tp1ep1pp1 on every rank (whole batch): logprobs with/without adapters, R3 from RoutesBatch, verl losses."""
    from ..lora.layers import adapter_factors
    from ..megatron.forward import forward_logits
    from ..policy.model import build_from_hf
    from ..megatron.layout import Layout
    from ..megatron.parallel import init_distributed
    from ..megatron.run_config import RunConfig
    from ..router_replay.align import align_microbatch
    from ..router_replay.replayer import Mode, RouterReplayer
    from ..algos import GlobalBatch, policy_loss
    from ..integration.verl.verl_config import lora_config
    from ..integration.verl.routes_dataproto import routes_from_verl

    rc = RunConfig(device="cpu", dtype="fp32")         # the host is prepared by worker_args
    init_distributed(Layout(), rc)
    seqs = real_tokens(b)
    S = max(len(s) for s in seqs)
    tokens = torch.zeros(N, S, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    _, base_model = build_from_hf(path, Layout(), rc)
    out = {"base": response_logprobs(forward_logits(base_model, tokens, arch.vocab_size), seqs, b)}
    del base_model
    _, model = build_from_hf(path, Layout(), rc, lora=lora_config(LORA))
    randomize_adapters(model, seed=1, scale=0.3)
    logits = forward_logits(model, tokens, arch.vocab_size)
    out["logprobs"] = response_logprobs(logits, seqs, b)
    out["entropy"] = response_entropy(logits, b)
    out["old"] = old = _old(b, out)
    # fp32 floor: the same unsharded model on the same rows, run in microbatches of MICRO rows (own padding)
    chunks = []
    for i in range(0, N, MICRO):
        part = seqs[i:i + MICRO]
        t = torch.zeros(len(part), max(len(x) for x in part), dtype=torch.long)
        for j, x in enumerate(part):
            t[j, : len(x)] = x
        lg = forward_logits(model, t, arch.vocab_size)
        chunks.append(torch.nn.functional.pad(lg, (0, 0, 0, S - lg.shape[1])))
    floor = response_logprobs(torch.cat(chunks), seqs, b)
    out["floor"] = float((floor - out["logprobs"]).abs()[b["resp_mask"].bool()].max())
    mask = b["resp_mask"].bool()
    gb = GlobalBatch(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=N)
    for mode in LOSSES:
        out[f"loss_{mode}"] = float(policy_loss(old, out["logprobs"], adv, mask, settings(mode), gb)[0])
    # gradient of the vanilla loss (differentiable forward through the same schedule)
    from ..megatron.forward import run_schedule

    model.train()
    grads = {}

    def on_output(logits_local, batch):
        lp = response_logprobs_autograd(logits_local, seqs, b, arch.vocab_size)
        loss = policy_loss(old, lp, adv, mask, settings("vanilla"), gb)[0]
        return loss, {"loss": loss.detach()}

    run_schedule(model, [{"tokens": tokens}], forward_only=False, on_output=on_output, seq_length=S,
                 micro_batch_size=N)
    sq = sum(float(p.grad.double().pow(2).sum()) for _, p in adapter_factors(model))
    grads["grad_norm"] = sq ** 0.5
    for _, p in adapter_factors(model):
        p.grad = None
    model.eval()
    out.update(grads)
    # R3: our RoutesBatch (from the same verl-format routes) replayed in the reference
    routes = routes_from_verl([torch.from_numpy(r.astype(np.int16)) for r in b["routes"]], [len(s) for s in seqs],
                              num_layers=arch.num_layers, moe_layer_ids=arch.moe_layer_ids,
                              num_experts=arch.num_experts, topk=arch.topk)
    rp = RouterReplayer(model)
    rp.set_mode(Mode.REPLAY)
    rp.queue_microbatch(align_microbatch(routes, list(range(N)), padded_len=S, stage_layers=rp.layer_ids))
    out["r3"] = response_logprobs(forward_logits(model, tokens, arch.vocab_size), seqs, b)
    rp.check_consumed()
    rp.detach()
    return out


def engine_run(path, layout_name, b, old, adv, ckpt_dir, adapters_to=None, resume_from=None) -> dict:
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import EngineRouterReplayConfig, HFModelConfig, TrainingWorkerConfig
    from verl.workers.config.optimizer import OptimizerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding
    from functools import partial

    from ..megatron.layout import Layout
    from ..algos import actor_config
    from ..integration.verl.verl_config import MoELoRAEngineConfig

    lay = Layout.parse(layout_name)
    ec = MoELoRAEngineConfig(tensor_model_parallel_size=lay.tp, expert_model_parallel_size=lay.ep,
                             expert_tensor_parallel_size=lay.etp, pipeline_model_parallel_size=lay.pp,
                             dtype="float32", device="cpu", router_replay=EngineRouterReplayConfig(mode="R3"),
                             use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO,
                             infer_micro_batch_size_per_gpu=MICRO)
    mc = HFModelConfig(path=path, lora=dict(LORA), external_lib="moe_lora_rl.integration.verl")
    w = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=mc, engine_config=ec,
                                            optimizer_config=OptimizerConfig(lr=1e-3, clip_grad=1e9)))
    w.reset()
    randomize_adapters(w.engine.model, seed=1, scale=0.3)
    out = {}
    if adapters_to is not None:                                # lora.adapter_path's adapters (verl_adapter_path.py)
        from .verl_adapter_path import write_adapters

        out["adapter_dirs"] = write_adapters(path, w.engine, w.engine.arch, adapters_to)
    out.update(stream_check(w.engine))
    dp, dpr = w.engine.get_data_parallel_size(), w.engine.get_data_parallel_rank()
    rows = list(range(dpr * N // dp, (dpr + 1) * N // dp))

    def gather(value):
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, (dpr, value if w.engine.is_mp_src_rank_with_outputs() else None))
        return got

    def logprobs(td_out, td):
        return no_padding_2_padding(tu.get(td_out, "log_probs"), td) if td_out is not None else None

    def assemble(got):
        full = torch.zeros(N, b["R"])
        for r, v in got:
            if v is not None:
                full[r * N // dp:(r + 1) * N // dp] = v
        return full

    td = verl_batch(b, old, adv, rows, routes=False)
    tu.assign_non_tensor(td, calculate_entropy=True)          # as verl's compute_log_prob asks
    res = w.infer_batch(td)
    out["logprobs"] = assemble(gather(logprobs(res, td)))
    out["entropy"] = assemble(gather(None if res is None else no_padding_2_padding(tu.get(res, "entropy"), td)))
    td = verl_batch(b, old, adv, rows, routes=False)
    tu.assign_non_tensor(td, no_lora_adapter=True)
    out["base"] = assemble(gather(logprobs(w.infer_batch(td), td)))
    td = verl_batch(b, old, adv, rows, routes=True)
    tu.assign_non_tensor(td, enable_routing_replay=True)
    out["r3"] = assemble(gather(logprobs(w.infer_batch(td), td)))
    w.set_loss_fn(partial(ppo_loss, actor_config(settings("gspo"))))
    td = verl_batch(b, old, adv, rows, routes=False)
    tu.assign_non_tensor(td, compute_loss=True)
    res = w.infer_batch(td)
    got = gather(None if res is None else tu.get(res, "metrics")["loss"])
    out["loss_gspo"] = next(v for _, v in got if v is not None)
    w.set_loss_fn(partial(ppo_loss, actor_config(settings("vanilla"))))
    out.update(minibatch_check(w, lambda r: verl_batch(b, old, adv, r, routes=False), rows))   # restores the state
    td = verl_batch(b, old, adv, rows, routes=False)
    tu.assign_non_tensor(td, global_token_num=None)
    res = w.train_batch(td)
    got = gather(None if res is None else (tu.get(res, "metrics")["loss"], tu.get(res, "metrics")["grad_norm"]))
    out["loss_vanilla"], out["grad_norm"] = next(v for _, v in got if v is not None)
    out.update(checkpoint_replay(w, lambda: verl_batch(b, old, adv, rows, routes=False), ckpt_dir))
    if resume_from:                          # another layout's checkpoint, loaded here: the same adapters, byte for byte
        out["ckpt_before_cross_digest"] = stream_check(w.engine)["stream_digests"][0]
        w.engine.load_checkpoint(resume_from)
        out["ckpt_cross_digest"] = stream_check(w.engine)["stream_digests"][0]
        out["ckpt_cross_version"] = w.engine.version
    return out


def minibatch_check(w, batch_of, rows: list[int]) -> dict:
    """verl's update_actor path, TrainingWorker.train_mini_batch, with ppo_mini_batch_size N/2 and ppo_epochs 2 (no
    shuffle): make_iterator cuts each DP rank's share into 2 mini-batches (rank r's j-th half of its rows), one
    TrainingWorker.train_batch each -> our engine's BaseEngine.train_batch: zero_grad, forward_backward_batch (the
    loss tokens counted over the mini-batch, all-reduced over DP), optimizer_step. Measured from the initial adapters:
    the version advance (the optimizer steps taken), the first mini-step's loss (main() compares it with the reference
    loss over that mini-batch's rows), and the adapters after it against TrainingWorker.train_batch called by hand on
    each rank's mini-batch rows in turn (so each step's gradient comes from its rows only); control: the mini-batches
    by hand in the other order. Adapters, AdamW state and version are restored afterwards."""
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu

    core = w.engine.core
    saved, version = [p.detach().clone() for p in core.params], core.version

    def restore():
        with torch.no_grad():
            for p, s in zip(core.params, saved):
                p.copy_(s)
        core.optimizer.state.clear()
        core.version = version

    def params():
        return [p.detach().clone() for p in core.params]

    def max_diff(a, c):
        d = torch.tensor(max(float((x - y).abs().max()) for x, y in zip(a, c)))
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        return float(d)

    half = len(rows) // 2
    td = batch_of(rows)
    tu.assign_non_tensor(td, global_batch_size=N // 2, mini_batch_size=N // 2, epochs=2, seed=0,
                         dataloader_kwargs={"shuffle": False})
    res = w.train_mini_batch(td)
    steps = core.version - version
    got = params()
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, None if res is None else list(tu.get(res, "metrics")["loss"]))
    first_rows = [None] * dist.get_world_size()
    dist.all_gather_object(first_rows, rows[:half])

    def by_hand(order):
        restore()
        for _ in range(2):
            for j in order:
                td = batch_of(rows[j * half:(j + 1) * half])
                tu.assign_non_tensor(td, global_batch_size=N // 2, global_token_num=None)
                w.train_batch(td)
        return params()

    hand, hand_version = by_hand([0, 1]), core.version - version
    reverse = by_hand([1, 0])
    restore()
    return {"mini_steps": steps, "mini_hand_steps": hand_version, "mini_vs_hand": max_diff(got, hand),
            "mini_vs_reverse": max_diff(got, reverse), "mini_losses": next(x for x in losses if x is not None),
            "mini_rows0": sorted({i for r in first_rows for i in r})}


def checkpoint_replay(w, batch, ckpt_dir) -> dict:
    """verl's save_checkpoint after step 1, steps 2 and 3, load_checkpoint, steps 2 and 3 again: the adapters after
    the replayed steps equal the first ones (max |diff| over every local factor, max over ranks). Each step is
    TrainingWorker.train_batch with update_lr_scheduler (verl's update path) under a warmup + cosine schedule
    (lr_schedule.py), so the replay also needs the schedule's position restored. Controls: the same replay with the
    optimizer state dropped after the load, and with the schedule not restored."""
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import McoreOptimizerConfig

    from ..integration.verl.lr_schedule import build_lr_scheduler
    from ..lora.layers import adapter_factors

    eng = w.engine
    eng.lr_scheduler = build_lr_scheduler(eng.optimizer, McoreOptimizerConfig(
        lr=1e-3, clip_grad=1e9, lr_decay_style="cosine", lr_warmup_steps=2, total_training_steps=8, min_lr=1e-4))
    lrs = []

    def step():
        td = batch()
        tu.assign_non_tensor(td, global_token_num=None, update_lr_scheduler=True)
        lrs.append(eng.optimizer.param_groups[0]["lr"])
        w.train_batch(td)

    def params():
        return [p.detach().clone() for _, p in adapter_factors(eng.model)]

    def max_diff(a, c):
        d = torch.tensor(max(float((x - y).abs().max()) for x, y in zip(a, c)))
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        return float(d)

    step()
    version = eng.version
    eng.save_checkpoint(ckpt_dir, global_step=1, max_ckpt_to_keep=1)
    saved_digest = stream_check(eng)["stream_digests"][0]
    step(), step()
    want = params()
    eng.load_checkpoint(ckpt_dir)
    loaded_version = eng.version
    step(), step()
    replay = max_diff(params(), want)
    eng.load_checkpoint(ckpt_dir)
    eng.optimizer.state.clear()
    step(), step()
    no_opt = max_diff(params(), want)
    # a load that leaves the schedule where it was: the first step still runs at the saved lr (AdamW's param_groups
    # are in its state), the second at the lr of the wrong position
    sched, eng.lr_scheduler = eng.lr_scheduler, None
    eng.load_checkpoint(ckpt_dir)
    eng.lr_scheduler = sched
    step(), step()
    return {"ckpt_replay_diff": replay, "ckpt_no_optimizer_diff": no_opt, "ckpt_saved_digest": saved_digest,
            "ckpt_no_schedule_diff": max_diff(params(), want), "ckpt_version_restored": loaded_version == version,
            "ckpt_lrs": lrs}


def main(argv=None):
    def add(ap):
        ap.add_argument("--model", required=True)
        ap.add_argument("--layouts", default="tp2ep2,pp2ep2")
        ap.add_argument("--adapter-layouts", default="tp1,tp2ep2", help="lora.adapter_path checked here ('': off)")

    for k, v in VERL_CPU_ENV.items():
        os.environ.setdefault(k, v)
    a = worker_args(argv, add)
    import torch.distributed as dist

    from ..models.arch import load_arch
    from ..megatron.parallel import teardown
    from ..integration.verl import plugin  # noqa: F401  (registers our engine and the CPU platform)
    from ..algos import grpo_advantages

    torch.manual_seed(0)
    arch = load_arch(a.model)
    b = make_batch(arch)
    adv = grpo_advantages(b["rewards"], b["resp_mask"], [i // GROUP for i in range(N)])
    ref = reference(a.model, arch, b, adv)
    result = {"layouts": {}, "fp32_batch_shape_floor": ref["floor"]}
    work = os.path.dirname(a.result)
    dirs, prev = None, None
    for name in a.layouts.split(","):
        teardown()
        got = engine_run(a.model, name, b, ref["old"], adv, os.path.join(work, f"ckpt-{name}"),
                         adapters_to=Path(work) / "adapters" if dirs is None and a.adapter_layouts else None,
                         resume_from=prev and os.path.join(work, f"ckpt-{prev}"))
        prev = name
        dirs = dirs or got.get("adapter_dirs")
        mask = b["resp_mask"].bool()
        d = lambda k: float((got[k] - ref[k]).abs()[mask].max())  # noqa: E731
        result["layouts"][name] = {
            "logprob_max_diff": d("logprobs"), "entropy_max_diff": d("entropy"), "base_max_diff": d("base"), "r3_max_diff": d("r3"),
            "r3_control_diff": float((got["r3"] - ref["logprobs"]).abs()[mask].max()),
            "adapter_effect": float((ref["logprobs"] - ref["base"]).abs()[mask].max()),
            "loss_vanilla_diff": abs(got["loss_vanilla"] - ref["loss_vanilla"]),
            "loss_gspo_diff": abs(got["loss_gspo"] - ref["loss_gspo"]),
            "loss_vanilla": got["loss_vanilla"], "loss_gspo": got["loss_gspo"],
            "grad_norm": got["grad_norm"], "grad_norm_ref": ref["grad_norm"],
            **{k: got[k] for k in ("ckpt_replay_diff", "ckpt_no_optimizer_diff", "ckpt_no_schedule_diff",
                                   "ckpt_version_restored", "ckpt_lrs", "stream_tensors", "stream_digests",
                                   "ckpt_saved_digest")},
            **{k: got[k] for k in ("ckpt_cross_digest", "ckpt_cross_version", "ckpt_before_cross_digest") if k in got},
            **minibatch_result(got, ref, adv, mask)}
    if dirs:
        from .verl_adapter_path import check

        result["adapter_path"] = check(a.model, a.adapter_layouts.split(","), dirs, LORA, b, ref["old"], adv,
                                       ref["base"])
    finish_worker(result, a.result)
    del dist


def minibatch_result(got: dict, ref: dict, adv: torch.Tensor, mask: torch.Tensor) -> dict:
    """The first mini-step's loss against verl's loss over that mini-batch's rows at the initial adapters,
    normalised by the mini-batch's tokens (the control: by the whole batch's, as if the split were ignored)."""
    from ..algos import GlobalBatch, policy_loss

    r = got["mini_rows0"]
    m = mask[r]

    def loss(tokens):
        gb = GlobalBatch(dp_size=1, batch_num_tokens=tokens, global_batch_size=len(r))
        return float(policy_loss(ref["old"][r], ref["logprobs"][r], adv[r], m, settings("vanilla"), gb)[0])

    first = float(np.asarray(got["mini_losses"], dtype=float).reshape(-1)[0])
    return {"mini_steps": got["mini_steps"], "mini_hand_steps": got["mini_hand_steps"],
            "mini_vs_hand": got["mini_vs_hand"], "mini_vs_reverse": got["mini_vs_reverse"],
            "mini_losses": got["mini_losses"], "mini_rows0": r, "mini_loss0_diff": abs(first - loss(int(m.sum()))),
            "mini_loss0_ctrl_diff": abs(first - loss(int(mask.sum())))}


def _old(b, ref):
    """Old log-probs: the reference's own, perturbed so ratios leave 1 and clipping engages."""
    return (ref["logprobs"] + b["noise"]) * b["resp_mask"]


if __name__ == "__main__":
    main()
