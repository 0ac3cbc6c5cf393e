"""torchrun worker: a keep_served run's trained samples (rl/served.py) recomputed by the Megatron trainer at each
layout, with the adapter version the engine served them with (imported from the tensors it received,
refit/import_peft.py) and the rollout's routes replayed, against the engine's logprobs.

    python -m torch.distributed.run --nproc_per_node=2 -m kit.served_megatron --out RUN_OUT_DIR \
        --model DIR --layouts tp1ep1pp1,ep2 --lora '{"rank": 8, ...}' --result R.json

Per layout, over every sample served by one version (a sample whose tokens span versions, inflight=switch, is left
out and counted: Megatron forwards a sequence with one adapter): max |trainer - engine| logprob over the response
tokens, the largest per-sample mean k3 KL; two negative controls: the routes shuffled over each sample's tokens (a
replay that did not reach the experts would pass that way), and the samples of a pushed version recomputed with the
adapters switched off (an adapter lost on the way to the engine would pass that way). Samples served before any push
(version None) are recomputed with the adapters switched off.
"""
from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from .inflight import served_record
from moe_lora_rl.checks.torchrun import each_layout, finish_worker, worker_args


def launch(out, model: str, layouts: str, lora: dict) -> dict:
    """This worker's result on a finished keep_served run in `out` (one 2-rank torchrun launch)."""
    import json

    from moe_lora_rl.checks.torchrun import run_torchrun

    return run_torchrun("kit.served_megatron", 2,
                        ["--out", str(out), "--model", model, "--layouts", layouts, "--lora", json.dumps(lora)])


def assert_served(rep: dict, samples: int) -> None:
    """Every layout recomputed at least `samples` samples within 1e-4 (logprob) and 1e-10 (per-sample k3) of the
    engine, while both controls (routes shuffled, adapter off) are > 1e-2 off."""
    for layout, r in rep["layouts"].items():
        assert r["samples"] >= samples, (layout, r)
        assert r["max_diff"] <= 1e-4 and r["k3_max"] <= 1e-10, (layout, r)
        assert r["shuffled_max_diff"] > 1e-2 and r["shuffled_k3_min"] > 1e-3, (layout, r)
        assert r["adapter_off_max_diff"] > 1e-2, (layout, r)


def _batch(samples: list[dict], arch, pad_id: int):
    from moe_lora_rl.rl.batching import policy_batch

    moe_layers = tuple(i for i, m in enumerate(arch.moe_layers) if m)
    rows = [SimpleNamespace(prompt=s["prompt"], response=s["response"], logprobs=s["logprobs"], routes=s["routes"])
            for s in samples]
    return policy_batch(rows, [0.0] * len(rows), list(range(len(rows))), pad_id, moe_layers=moe_layers,
                        num_experts=arch.num_experts, topk=arch.topk)


def _shuffled(batch, seed: int = 11):
    """The batch with each sample's routes permuted over its tokens."""
    g = np.random.default_rng(seed)
    moved = [s[g.permutation(s.shape[0])] for s in batch.routes.samples]
    return replace(batch, routes=replace(batch.routes, samples=moved))


def _compare(lp: torch.Tensor, batch) -> tuple[float, float]:
    """(max |diff|, the largest per-sample mean k3) over the response tokens."""
    mask = batch.loss_mask
    d = (lp.double() - batch.rollout_logprobs.double()) * mask
    k3 = (torch.exp(d) - 1 - d).sum(1) / mask.sum(1).clamp(min=1)
    return float(d.abs().max()), float(k3.max())


def main(argv=None):
    def add(ap):
        ap.add_argument("--out", required=True, help="the run's out_dir (keep_served=true)")
        ap.add_argument("--model", required=True, help="the run's model dir")
        ap.add_argument("--layouts", default="tp1ep1pp1")
        ap.add_argument("--temperature", type=float, default=1.0)

    a = worker_args(argv, add, lora=True)
    import transformers

    from moe_lora_rl.algos import PolicyLossSettings
    from moe_lora_rl.policy.core import Policy
    from moe_lora_rl.refit.import_peft import load_peft

    adapters, steps = served_record(a.out)
    pad = transformers.AutoTokenizer.from_pretrained(a.model).pad_token_id
    result: dict = {"versions": sorted(adapters), "steps": sorted(steps), "layouts": {}}
    for key, layout in each_layout(a.layouts, a.rc):
        pol = Policy(a.model, layout, a.rc, a.lora, lr=0.0, weight_decay=0.0, grad_clip=1.0,
                     loss=PolicyLossSettings(), micro_batch_size=1, temperature=a.temperature)
        dp = int(os.environ["WORLD_SIZE"]) // (layout.tp * layout.pp)
        rec = {"samples": 0, "multi_version": 0, "left_out": 0, "max_diff": 0.0, "k3_max": 0.0,
               "shuffled_max_diff": float("inf"), "shuffled_k3_min": float("inf"),
               "adapter_off_max_diff": float("inf"), "by_version": {}}
        for step, samples in sorted(steps.items()):
            one = {}
            for s in samples:
                vs = set(s["versions"])
                if len(vs) > 1:
                    rec["multi_version"] += 1
                    continue
                one.setdefault(vs.pop(), []).append(s)
            for v, group in sorted(one.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
                keep = len(group) - len(group) % dp
                rec["left_out"] += len(group) - keep
                if not keep:
                    continue
                batch = _batch(group[:keep], pol.arch, pad)
                if v is not None:
                    load_peft(pol.model, pol.arch, adapters[v])
                lp = pol.logprobs(batch, replay="r3", adapter=v is not None).logprobs
                worst, k3 = _compare(lp, batch)
                sh_worst, sh_k3 = _compare(pol.logprobs(_shuffled(batch), replay="r3",
                                                        adapter=v is not None).logprobs, batch)
                if v is not None:          # control: the same samples without the adapter the engine served
                    off, _ = _compare(pol.logprobs(batch, replay="r3", adapter=False).logprobs, batch)
                    rec["adapter_off_max_diff"] = min(rec["adapter_off_max_diff"], off)
                rec["samples"] += keep
                rec["max_diff"], rec["k3_max"] = max(rec["max_diff"], worst), max(rec["k3_max"], k3)
                rec["shuffled_max_diff"] = min(rec["shuffled_max_diff"], sh_worst)
                rec["shuffled_k3_min"] = min(rec["shuffled_k3_min"], sh_k3)
                by = rec["by_version"].setdefault(str(v), {"samples": 0, "max_diff": 0.0, "k3_max": 0.0})
                by["samples"] += keep
                by["max_diff"], by["k3_max"] = max(by["max_diff"], worst), max(by["k3_max"], k3)
        result["layouts"][key] = rec
        del pol
    finish_worker(result, a.result)


if __name__ == "__main__":
    main()
