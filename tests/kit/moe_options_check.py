"""The MoE block's megatron-core options (shared-expert overlap, dispatchers, grouped GEMM) at expert- and
tensor-parallel layouts against the plain layout: one forward + backward of LoRA on every target with B non-zero
(moe_options_worker), eval logits and every adapter factor's synced gradient compared with the reference variant.

    report = run(models, VARIANTS, LoRAConfig(rank=4, alpha=8.0), workdir)
    report[name][model] = {"logits_rel_diff", "grad_max_rel_diff", "worst_grad", "zero_grads", "loss"}
                          (name: a variant's, or VARIANT+CONTROL with "broken_adapters" too)

Every variant runs at world size 2 in one torchrun launch (REFERENCE is tp1 there: data parallel 2).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_lora_rl.lora import LoRAConfig
from moe_lora_rl.checks.torchrun import run_torchrun, worker_arg

REFERENCE = "plain"
OVERLAP = {"moe_shared_expert_overlap": True}
ALLGATHER = {"moe_token_dispatcher_type": "allgather"}
GROUPED = {"moe_grouped_gemm": True}
# negative controls (stepped on the variant's model after its own step): an expert or shared-expert delta counted
# once per rank, or cut from autograd; each must fail the comparison its variant passes
ETP_CONTROLS = ["double:expert_fc2"]
OVERLAP_CONTROLS = ["double:shared_fc1", "detach:shared_fc2"]
# CI: ETP2; TP2 with shared-expert overlap; grouped GEMM with EP, TP and overlap at once
VARIANTS = [
    {"name": REFERENCE, "layout": "tp1"},
    {"name": "etp2", "layout": "etp2", "controls": ETP_CONTROLS},
    {"name": "tp2_overlap", "layout": "tp2", "overrides": OVERLAP, "controls": OVERLAP_CONTROLS},
    {"name": "tp2ep2_grouped_overlap", "layout": "tp2ep2", "overrides": {**GROUPED, **OVERLAP}},
]
# slow: the other combinations at world size 2
MORE_VARIANTS = [
    {"name": "tp2", "layout": "tp2"},
    {"name": "tp2etp2_overlap", "layout": "tp2etp2", "overrides": OVERLAP},
    {"name": "ep2_overlap", "layout": "ep2", "overrides": OVERLAP},
    {"name": "tp2_allgather", "layout": "tp2", "overrides": ALLGATHER},
    {"name": "etp2_allgather", "layout": "etp2", "overrides": ALLGATHER},
    {"name": "etp2_grouped", "layout": "etp2", "overrides": GROUPED},
]


def make_data(models: list[str], out: Path, n: int = 4, s: int = 32, seed: int = 3) -> None:
    """Per model: a training batch [n, s] and an eval batch [2, s] of seeded random tokens."""
    from moe_lora_rl.models.arch import load_arch

    data = {}
    for m in models:
        g = torch.Generator().manual_seed(seed)
        vocab = load_arch(m).vocab_size
        data[m] = {"train": torch.randint(0, vocab, (n, s), generator=g),
                   "eval": torch.randint(0, vocab, (2, s), generator=g)}
    torch.save(data, out / "data.pt")


def compare(ref: dict, got: dict) -> dict:
    """max |logit diff| / max |reference logit|; the largest gradient difference over factors, each relative to the
    reference factor's largest entry; factors whose gradient is exactly zero."""
    if set(got["grads"]) != set(ref["grads"]):
        raise AssertionError(f"adapter names differ: {sorted(set(got['grads']) ^ set(ref['grads']))[:6]}")
    rel = {k: ((got["grads"][k] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
           for k, g in ref["grads"].items()}
    return {"logits_rel_diff": ((got["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max()).item(),
            "grad_max_rel_diff": max(rel.values()), "worst_grad": max(rel, key=rel.get),
            "zero_grads": sorted(k for k, g in got["grads"].items() if not g.any())}


def run(models: list[str], variants: list[dict], cfg: LoRAConfig, workdir: Path, rc=None) -> dict:
    return report(models, variants, workdir, run_torchrun("kit.moe_options_worker", 2,
                                                          worker_argv(models, variants, cfg, workdir, rc)))


def worker_argv(models: list[str], variants: list[dict], cfg: LoRAConfig, workdir: Path, rc=None) -> list[str]:
    """The data written to workdir and the worker's arguments (world size 2), for run or a shared launch."""
    from moe_lora_rl.megatron.run_config import RunConfig

    if variants[0]["name"] != REFERENCE:
        raise ValueError(f"variants must start with the reference {REFERENCE!r}, got {variants[0]['name']!r}")
    workdir.mkdir(parents=True, exist_ok=True)
    make_data(models, workdir)
    return ["--models", ",".join(models), "--variants", json.dumps(variants), "--data", str(workdir / "data.pt"),
            "--lora", json.dumps(cfg.to_dict()), "--out", str(workdir), *worker_arg(rc or RunConfig())]


def report(models: list[str], variants: list[dict], workdir: Path, summary: dict) -> dict:
    """The worker's summary with each variant compared to the reference (the tensors it saved in workdir)."""
    names = [v["name"] for v in variants] + [f"{v['name']}+{c}" for v in variants for c in v.get("controls", ())]
    out: dict = {}
    for mi, m in enumerate(models):
        ref = torch.load(workdir / f"{REFERENCE}-m{mi}.pt")
        for name in names:
            rec = dict(summary[name][m])
            rec.update(compare(ref, torch.load(workdir / f"{name}-m{mi}.pt")))
            out.setdefault(name, {})[m] = rec
    return out
