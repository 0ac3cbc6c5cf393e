"""torchrun worker (2 ranks): activation recompute with R3 replay gives the same logprobs and adapter gradients as
no recompute, at each layout; rank 0 writes the comparison as JSON.

Per layout, on the tiny GLM4-MoE (dense layer 0, MoE layers 1-3 with shared experts), per-expert LoRA on every
target, adapters perturbed deterministically, the batch of policy_update_worker (8 rows of mixed lengths, R3 routes
of random experts: the router's own choice differs from the replayed one in ~3/4 of the decisions), lr=0 so the
adapters never move:
  variants: none | full uniform 1 (verl's example) | full block 2 (layers 0-1 recomputed, 2-3 not) | selective
      (core_attn, layernorm, mlp, moe, shared_experts);
  each: the eval logprobs (forward only, r3), one update (r3, its own forward as proximal policy: the training
      forward's logprobs), the gathered adapter gradients, the routes replayed in forwards and again in the
      recompute per layer (RouterReplayer.consumed) and check_consumed (inside TrainingCore.run).
Negative controls on the full-uniform model: (1) the recompute routes freely (the recompute queue off, the router's
own top-k in backward): the gradients differ; (2) at pp1, without the frozen-base hook (build.frozen_base_recompute):
the checkpointed layers' output has no grad (the error and the factors without gradient are reported).
"""
from __future__ import annotations

import time
import types

import torch
import torch.distributed as dist

from moe_lora_rl.algos import PolicyLossSettings
from moe_lora_rl.lora import LoRAConfig, gather_adapters
from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.megatron.parallel import init_distributed, teardown
from moe_lora_rl.models import get_model
from moe_lora_rl.policy.core import Policy
from moe_lora_rl.router_replay.replayer import in_backward
from moe_lora_rl.checks.adapters import randomize_adapters
from moe_lora_rl.checks.torchrun import finish_worker, worker_args
from .policy_update_worker import make_batch, rel_diff

VARIANTS = {
    "none": {},
    "full_uniform_1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full_block_2": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    "selective": {"recompute_granularity": "selective",
                  "recompute_modules": ["core_attn", "layernorm", "mlp", "moe", "shared_experts"]},
}


def _policy(path, layout, rc, override) -> Policy:
    pol = Policy(path, layout, rc, LoRAConfig(rank=4, alpha=8.0), lr=0.0, weight_decay=0.0, grad_clip=1e9,
                 loss=PolicyLossSettings(), micro_batch_size=1, temperature=0.9,
                 override_transformer_config=override)
    randomize_adapters(pol.model, seed=7, b_scale=0.05)
    return pol


def _measure(pol: Policy, batch) -> dict:
    lp = pol.logprobs(batch, replay="r3")
    eval_consumed = pol.replayer.consumed()
    prox: list = []
    stats = pol.update(batch, None, replay="r3", proximal_out=prox)
    return {"logprobs": lp.logprobs, "train_logprobs": prox[0].logprobs, "grads": gather_adapters(pol.model, grads=True),
            "loss": stats["loss"], "consumed": _summed(pol.replayer.consumed(), pol.arch),
            "eval_consumed": _summed(eval_consumed, pol.arch)}


def _summed(consumed: dict, arch) -> dict:
    """{global MoE layer: [forward, recompute]} summed over ranks (each pipeline stage holds its own layers)."""
    t = torch.zeros(arch.num_layers, 2, dtype=torch.long)
    for layer, counts in consumed.items():
        t[layer] = torch.tensor(counts)
    dist.all_reduce(t)
    return {str(k): t[k].tolist() for k in arch.moe_layer_ids}


def _free_recompute(pol: Policy) -> None:
    """Control: the recompute computes routes with the router's own top-k instead of reusing the replayed ones."""
    for r in pol.replayer.replays:
        r.recompute = False
        replay = r.get_replay_topk

        def free(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None, _replay=replay):
            if in_backward():
                return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            return _replay(scores, topk, num_groups, group_topk, default_compute_topk)

        r.get_replay_topk = types.MethodType(free, r)


def run_layout(path: str, key: str, rc, variants: list[str]) -> dict:
    layout = Layout.parse(key)
    init_distributed(layout, rc)
    out: dict = {}
    for name in ["none", *[v for v in variants if v != "none"]]:
        override = VARIANTS[name]
        t0 = time.perf_counter()
        pol = _policy(path, layout, rc, override)
        batch, _ = make_batch(pol.arch.vocab_size, tuple(pol.arch.moe_layer_ids), pol.arch.num_experts, pol.arch.topk)
        out[name] = _measure(pol, batch)
        if name == "full_uniform_1":
            _free_recompute(pol)
            out["ctrl_free_recompute"] = _measure(pol, batch)
            pol.replayer.clear()
        if name == "full_uniform_1" and layout.pp == 1:     # pp2: only the first stage lacks the hook (ranks diverge)
            pol.replayer.detach()
            pol = _policy(path, layout, rc, override)
            pol.model._recompute_hook.remove()
            try:
                out["ctrl_no_hook"] = _measure(pol, batch)
            except (RuntimeError, ValueError) as e:         # every rank fails alike, before any collective
                grads = gather_adapters(pol.model, grads=True)
                out["ctrl_no_hook"] = {"error": str(e).splitlines()[0],
                                       "zero_grad_factors": sum(float(v.abs().max()) == 0.0 for v in grads.values()),
                                       "n_factors": len(grads)}
        pol.replayer.detach()
        del pol
        out[name]["seconds"] = round(time.perf_counter() - t0, 1)
    dist.barrier()
    teardown()
    return out


def compare(res: dict) -> dict:
    rep: dict = {}
    for key, per in res.items():
        ref = per["none"]
        rows = {}
        for name, r in per.items():
            if "error" in r:
                rows[name] = r
                continue
            rows[name] = {
                "logprob_max_diff": float((r["logprobs"] - ref["logprobs"]).abs().max()),
                "train_logprob_max_diff": float((r["train_logprobs"] - ref["train_logprobs"]).abs().max()),
                "grad_max_diff": max(float((r["grads"][k] - ref["grads"][k]).abs().max()) for k in ref["grads"]),
                "grad_rel_diff": rel_diff(r["grads"], ref["grads"]), "loss": r["loss"],
                "grad_scale": max(float(v.abs().max()) for v in ref["grads"].values()),
                "zero_grad_factors": sum(float(v.abs().max()) == 0.0 for v in r["grads"].values()),
                "n_factors": len(r["grads"]), "consumed": r["consumed"], "eval_consumed": r["eval_consumed"],
                "seconds": r.get("seconds")}
        rep[key] = rows
    return rep


def main(argv=None):
    def add(ap):
        ap.add_argument("--layouts", default="tp1ep1pp1,tp2ep2")
        ap.add_argument("--variants", default=",".join(VARIANTS), help="compared with 'none' (always run)")

    a = worker_args(argv, add)
    path = str(get_model("glm4_moe", "tiny"))
    res = {}
    for key in a.layouts.split(","):
        out = run_layout(path, key, a.rc, a.variants.split(","))
        if dist.get_rank() == 0:
            res[key] = out
    finish_worker(compare(res) if dist.get_rank() == 0 else {}, a.result)


if __name__ == "__main__":
    main()
