"""parity: max |fp32 logit diff| between Megatron at each layout and HF transformers. Target: <= 1e-4.

    python -m moe_lora_rl.bench parity --json [--model DIR ...] [--layouts tp2ep2,pp2ep2]
"""
from __future__ import annotations

import argparse
import time

from ..testing.launch import run_torchrun
from .common import DEFAULT_LAYOUTS, check_layouts, emit, group_by_world, resolve_models

TARGET = 1e-4


def run(models: list[str], layouts: str) -> dict:
    check_layouts(models, layouts)                     # bad layouts fail here, before any process starts
    t0 = time.time()
    per_layout: dict[str, dict[str, float]] = {}
    for world, names in group_by_world(layouts).items():
        per_layout.update(run_torchrun("moe_lora_rl.bench.parity_worker", world,
                                       ["--models", ",".join(models), "--layouts", ",".join(names)]))
    worst = {name: max(d.values()) for name, d in per_layout.items()}
    return {"layouts": worst, "max_abs_diff": max(worst.values()), "models": models, "per_model": per_layout,
            "target": TARGET, "wall_s": round(time.time() - t0, 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench parity", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--model", action="append", help="HF checkpoint directory (repeatable); default: tiny models")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated layouts, e.g. tp2ep2,pp2ep2")
    a = ap.parse_args(argv)
    result = run(resolve_models(a.model), a.layouts)
    emit(result, a.json)
    return result
