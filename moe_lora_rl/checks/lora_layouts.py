"""Train LoRA at several layouts on identical data and compare everything against the unsharded reference.

reference layout tp1ep1pp1 (world 1) first; every other layout (one torchrun launch per world size) also loads the
reference's sharded checkpoint into fresh adapters, so save-at-one-layout / load-at-another is checked too.
run_many: several such runs in lockstep (every run's reference in one launch, then one launch per world size).
peft_diff: a trained adapter exported to PEFT and loaded into HF transformers + peft, against Megatron+LoRA.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..lora import LoRAConfig
from .torchrun import run_torchrun_jobs, worker_arg
from .layouts import dp_batch, group_by_world

REFERENCE = "tp1ep1pp1"


def make_data(models: list[str], out: Path, n: int = 4, s: int = 16) -> dict:
    """Per model: a training batch with an empty and an odd-loaded expert in one MoE layer, and an eval batch."""
    from .data import uneven_batch
    from .hf import hf_model

    data, info = {}, {}
    for m in models:
        hf = hf_model(m)
        train, why = uneven_batch(hf, n, s, hf.config.vocab_size)
        g = torch.Generator().manual_seed(7)
        data[m] = {"train": train, "eval": torch.randint(0, hf.config.vocab_size, (2, s), generator=g)}
        info[m] = why
    torch.save(data, out / "data.pt")
    return info


def run(models: list[str], layouts: str, cfg: LoRAConfig, workdir: Path, steps: int = 3, lr: float = 1e-4,
        grouped: bool = False, rc=None, controls: bool = False, peft: bool = False) -> dict:
    """grouped: the non-reference layouts use the legacy GroupedMLP; the reference stays SequentialMLP.
    rc: the Megatron RunConfig of every layout (default fp32 on CPU).
    controls: per non-reference layout, "controls": {"drop:TARGET" | "perturb:TARGET": max |logit diff| against
    the reference} with that target's adapters dropped or one factor perturbed (each must exceed the tolerance).
    peft: every layout also exports its trained adapter as the main job does (workdir/peft-LAYOUT-mI)."""
    return run_many([dict(models=models, layouts=layouts, cfg=cfg, workdir=workdir, steps=steps, lr=lr,
                          grouped=grouped, rc=rc, controls=controls, peft=peft)])[0]


def run_many(runs: list[dict]) -> list[dict]:
    """Each run's report (runs: run's keyword arguments); the runs in lockstep: every reference in one launch of one
    rank, then per world size every run's layouts of that size in one launch (torchrun.run_torchrun_jobs)."""
    from ..megatron.layout import Layout
    from ..megatron.run_config import RunConfig

    worker, plans = "moe_lora_rl.checks.lora_worker", []
    for r in runs:
        workdir = r["workdir"]
        workdir.mkdir(parents=True, exist_ok=True)
        names = [n.strip() for n in r["layouts"].split(",") if n.strip() and n.strip() != REFERENCE]
        n = dp_batch([Layout.parse(x) for x in [REFERENCE] + names], 4)    # the same batch splits at every layout
        load_info = make_data(r["models"], workdir, n=n)
        common = ["--models", ",".join(r["models"]), "--data", str(workdir / "data.pt"),
                  "--lora", json.dumps(r["cfg"].to_dict()), "--steps", str(r.get("steps", 3)),
                  "--lr", str(r.get("lr", 1e-4)), "--out", str(workdir), *worker_arg(r.get("rc") or RunConfig())]
        common += ["--peft"] if r.get("peft") else []
        groups = {world: common + ["--layouts", ",".join(group), "--load-from", REFERENCE]
                  + (["--grouped"] if r.get("grouped") else []) + (["--controls"] if r.get("controls") else [])
                  for world, group in group_by_world(",".join(names)).items()}
        plans.append((r["models"], workdir, names, load_info, common + ["--layouts", REFERENCE], groups))
    summaries = run_torchrun_jobs(1, [(worker, p[4]) for p in plans])
    for world in sorted({w for p in plans for w in p[5]}):
        idx = [i for i, p in enumerate(plans) if world in p[5]]
        for i, got in zip(idx, run_torchrun_jobs(world, [(worker, plans[i][5][world]) for i in idx])):
            summaries[i].update(got)
    return [_report(*p[:4], summary) for p, summary in zip(plans, summaries)]


def _report(models: list[str], workdir: Path, names: list[str], load_info: dict, summary: dict) -> dict:
    report: dict = {"per_layout": {}, "expert_load": load_info}
    for mi, m in enumerate(models):
        ref = torch.load(workdir / f"{REFERENCE}-m{mi}.pt")
        for name in [REFERENCE] + names:
            got = torch.load(workdir / f"{name}-m{mi}.pt")
            rec = dict(summary[name][m])
            if set(got["adapters"]) != set(ref["adapters"]):
                raise AssertionError(f"{name}: adapter names differ from the reference: "
                                     f"{sorted(set(got['adapters']) ^ set(ref['adapters']))[:6]}")
            rec["adapter_max_diff"] = max((got["adapters"][k] - ref["adapters"][k]).abs().max().item()
                                          for k in ref["adapters"])
            if got.get("grads"):
                rec["grad_max_diff"] = max((got["grads"][k] - ref["grads"][k]).abs().max().item()
                                           for k in ref["grads"])
                rec["grad_max_abs"] = max(t.abs().max().item() for t in ref["grads"].values())
            rec["loss_max_diff"] = max(abs(x - y) for x, y in zip(got["losses"], ref["losses"]))
            rec["eval_logits_max_diff"] = (got["eval_logits"] - ref["eval_logits"]).abs().max().item()
            rec["ref_logits_max_abs"] = ref["eval_logits"].abs().max().item()
            if "loaded_adapters" in got:          # the reference's checkpoint loaded here, gathered again
                rec["loaded_adapter_max_diff"] = max((got["loaded_adapters"][k] - ref["adapters"][k]).abs().max()
                                                     .item() for k in ref["adapters"])
            if "loaded_logits" in got:
                rec["loaded_logits_max_diff"] = (got["loaded_logits"] - ref["eval_logits"]).abs().max().item()
            if "control_logits" in got:
                rec["controls"] = {k: (v - ref["eval_logits"]).abs().max().item()
                                   for k, v in got["control_logits"].items()}
            report["per_layout"].setdefault(name, {})[m] = rec
    report["layout_max_diff"] = max(max(r["adapter_max_diff"], r["loss_max_diff"])
                                    for per in report["per_layout"].values() for r in per.values())
    return report


def peft_diff(model_dir: str, blob_path: Path, cfg: LoRAConfig, out: Path) -> float:
    """Export a trained adapter blob (canonical tensors + Megatron eval logits) to PEFT and compare in HF."""
    from ..lora.peft_hf import peft_logits
    from ..models.arch import load_arch
    from ..refit.export import save_peft

    blob = torch.load(blob_path)
    data = torch.load(blob_path.parent / "data.pt")[model_dir]
    save_peft(blob["adapters"], load_arch(model_dir), cfg, out, base_model=model_dir)
    return (peft_logits(model_dir, out, data["eval"]) - blob["eval_logits"]).abs().max().item()
