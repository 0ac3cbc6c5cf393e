"""recompute: peak memory of a LoRA training step without and with activation recompute, side by side.

    python -m moe_lora_rl.bench recompute --json [--model DIR] [--seq 2048] [--batch 1] [--layout tp1ep1pp1]

Each variant (verl's override_transformer_config: none; full/uniform/1 as in verl's Megatron LoRA example;
selective core_attn+layernorm+moe) runs LoRA training steps (fwd + bwd + adapter grad sync + AdamW) in its own
torchrun launch of bench/workers/lora_steps_worker (--measure memory), so no variant's allocations hide another's. Per
variant: step_mb, the kernel's resident-set high-water mark (ru_maxrss, reset before the steps) minus the RSS
before the first step (activations at their peak plus grads, optimizer state and allocator slack); saved_mb, the
tensors autograd holds for backward at the end of the forward (the activations recompute trades for compute);
peak_mb, from before the model exists; step_s. Ratios are against no recompute. Default model: glm4_moe wide (the
RL default: 128 experts top-8, dense layer 0, shared experts) at a long sequence.
"""
from __future__ import annotations

import argparse
import json
import time

from ..checks.torchrun import run_torchrun, worker_arg
from ..lora import LoRAConfig
from ..megatron.layout import Layout
from .emit import emit
from .run_args import add_run_args, run_config_from_args

VARIANTS = {
    "none": {},
    "full_uniform_1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "layernorm", "moe"]},
}


def measure(model: str, layout: str, seq: int, batch: int, cfg: LoRAConfig, rc, variants: list[str]) -> dict:
    out = {}
    for name in variants:
        t0 = time.perf_counter()
        out[name] = run_torchrun("moe_lora_rl.bench.workers.lora_steps_worker", Layout.parse(layout).min_world_size,
                                 ["--model", model, "--layout", layout, "--measure", "memory", "--variant", "lora",
                                  "--seq", str(seq), "--batch", str(batch), "--lora", json.dumps(cfg.to_dict()),
                                  "--transformer-overrides", json.dumps(VARIANTS[name]), *worker_arg(rc)],
                                 timeout=1800)
        out[name]["launch_s"] = round(time.perf_counter() - t0, 1)
    base = out["none"]
    res = {"per_variant": {n: {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}
                           for n, r in out.items()},
           "overrides": {n: VARIANTS[n] for n in variants}}
    for n in variants[1:]:
        res[f"{n}_step_mb_ratio"] = out[n]["step_mb"] / base["step_mb"]
        res[f"{n}_saved_mb_ratio"] = out[n]["saved_mb"] / base["saved_mb"]
    res["memory_measured_by"] = ("step_mb: ru_maxrss high-water (reset before the steps) minus RSS before the first "
                                 "step; saved_mb: autograd saved-tensor hooks (unique storages, parameters excluded)")
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench recompute", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="HF checkpoint; default: glm4_moe wide")
    ap.add_argument("--layout", default="tp1ep1pp1")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {tuple(VARIANTS)}; "
                    "'none' is always measured first")
    add_run_args(ap)
    a = ap.parse_args(argv)
    rc = run_config_from_args(a, ap.prog)
    variants = ["none", *[v for v in a.variants.split(",") if v != "none"]]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants {unknown}: choose from {tuple(VARIANTS)}")
    if a.seq < 2 or a.batch < 1:
        raise ValueError(f"--seq {a.seq} --batch {a.batch}: need seq >= 2 and batch >= 1")
    model = a.model
    if model is None:
        from ..models import get_model

        model = str(get_model("glm4_moe", "wide"))
    result = measure(model, a.layout, a.seq, a.batch, LoRAConfig(rank=a.rank, alpha=a.alpha), rc, variants)
    result.update({"model": model, "layout": a.layout, "seq": a.seq, "batch": a.batch, "dtype": rc.dtype,
                   "rank": a.rank})
    emit(result, a.json)
    return result
