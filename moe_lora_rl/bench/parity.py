"""parity: Megatron at each layout vs HF transformers (fp32 logits).

    python -m moe_lora_rl.bench parity --json [--model DIR ...] [--layouts tp2ep2,pp2ep2] [--dtype bf16]

fp32: max |logit diff|, target 1e-4 (fp32 reduction orders; a wrong shard gives differences of order 1).
bf16: the median over tokens of each token's max |logit diff|, relative to max |fp32 logit|, target 8u with
u = 2^-8 (bf16's unit roundoff): every matmul output, residual add and norm rounds to 8 significant bits, so a
logit of magnitude |z| carries a few u*|z| of error (measured 2-4u). The median leaves out the few tokens whose
top-k routing flips under bf16 rounding (measured 0.5-1% of router decisions); those move a token's logits by O(1),
exactly as in HF transformers' own bf16 forward.
"""
from __future__ import annotations

import argparse
import time

from ..checks.launch import run_torchrun
from .common import DEFAULT_LAYOUTS, check_layouts, emit, group_by_world, resolve_models
from .run_args import add_run_args, run_config_from_args, worker_arg

TARGET = 1e-4
BF16_UNIT_ROUNDOFF = 2.0 ** -8
TARGET_BF16 = 8 * BF16_UNIT_ROUNDOFF


def run(models: list[str], layouts: str, rc=None) -> dict:
    from ..megatron.run_config import RunConfig

    rc = rc or RunConfig()
    check_layouts(models, layouts)                     # bad layouts fail here, before any process starts
    t0 = time.time()
    details: dict[str, dict[str, dict]] = {}
    for world, names in group_by_world(layouts).items():
        details.update(run_torchrun("moe_lora_rl.bench.parity_worker", world,
                                    ["--models", ",".join(models), "--layouts", ",".join(names), *worker_arg(rc)]))
    key, target = ("max_abs", TARGET) if rc.dtype == "fp32" else ("rel_median_token", TARGET_BF16)
    per_layout = {name: {m: r[key] for m, r in d.items()} for name, d in details.items()}
    worst = {name: max(d.values()) for name, d in per_layout.items()}
    out = {"layouts": worst, "max_abs_diff" if rc.dtype == "fp32" else "max_rel_median_token": max(worst.values()),
           "models": models, "per_model": per_layout, "target": target, "metric": key, "dtype": rc.dtype,
           "wall_s": round(time.time() - t0, 1)}
    if rc.dtype != "fp32":
        out["details"] = details
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench parity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--model", action="append", help="HF checkpoint directory (repeatable); default: tiny models")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated layouts, e.g. tp2ep2,pp2ep2")
    add_run_args(ap)
    a = ap.parse_args(argv)
    rc = run_config_from_args(a, ap.prog)
    result = run(resolve_models(a.model), a.layouts, rc)
    emit(result, a.json)
    return result
