"""plan: the layout planner's step-time model calibrated at one batch size, checked at another, side by side.

    python -m moe_lora_rl.bench plan --json [--model DIR] [--calibration-batch 4] [--predicted-batch 16]

The step predicted and measured is the shape of the main job's synchronous step, its two sides timed apart so that
each of the planner's inputs is checked on its own, on one CPU: vLLM CPU generation of a batch (bf16, the whole batch in flight) followed by one
Megatron LoRA training step on the same batch (fwd + bwd + adapter grad sync + AdamW, microbatch 1). Refit is
left out of both sides (measured by `bench refit`).

Calibration (batch b1): the rollout time gives the achieved decode bandwidth (the planner's roofline: bytes the
batch touches per step / seconds per step; a matmul measures the compute ceiling), the training step gives the
achieved fraction of that ceiling. Prediction (batch b2): the planner's own step_times() with those figures.
Both batches are measured in the same run, interleaved. Times are process CPU seconds of single-threaded workers
(OMP_NUM_THREADS=1), so other jobs on a shared machine do not distort them; wall times are reported alongside.
The "hardware" object is a calibrated hardware file for `moe-lora-rl plan --hardware-json`.
"""
from __future__ import annotations

import argparse
import sys

from ..checks.tolerances import PLAN_ERROR_TARGET
from .emit import emit
from .runners.plan_model import calibrate, compare, predict, settings
from .runners.plan_runs import matmul_flops, measure


def run(model: str, b1: int, b2: int, prompt_len: int, response_len: int, rank: int, repeats: int) -> dict:
    from ..plan.specs import load_model

    m = load_model(model)
    meas = measure(model, [b1, b2], prompt_len, response_len, rank, repeats)
    rl1, rl2 = (settings(b, prompt_len, response_len, rank) for b in (b1, b2))
    out = {}
    for timer in ("cpu_s", "wall_s"):
        r, t = meas["rollout"][timer], meas["train"][timer]
        hw = calibrate(m, rl1, r[str(b1)], t[str(b1)], matmul_flops())
        pred = predict(m, hw, rl2)
        res = compare(pred["step_s"], r[str(b2)] + t[str(b2)], b1, b2)
        res.update({"predicted": pred, "measured": {"rollout_s": r[str(b2)], "train_s": t[str(b2)],
                                                    "step_s": r[str(b2)] + t[str(b2)]},
                    "calibration": {"rollout_s": r[str(b1)], "train_s": t[str(b1)]}, "hardware": hw.to_dict()})
        out[timer] = res
    result = {k: out["cpu_s"][k] for k in ("predicted_steps_per_min", "measured_steps_per_min", "error",
                                           "calibration_batch", "predicted_batch")}
    result.update({"timer": "process CPU seconds (single-threaded workers)", "target": PLAN_ERROR_TARGET,
                   "what": "synchronous rollout (vLLM CPU, bf16) + Megatron LoRA update step, timed apart",
                   "model": model, "prompt_len": prompt_len, "response_len": response_len, "rank": rank,
                   "predicted": out["cpu_s"]["predicted"], "measured": out["cpu_s"]["measured"],
                   "calibration": out["cpu_s"]["calibration"], "hardware": out["cpu_s"]["hardware"],
                   "wall": {k: out["wall_s"][k] for k in ("predicted_steps_per_min", "measured_steps_per_min",
                                                          "error", "measured")}})
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", action="append", help="HF checkpoint dir (default: the medium qwen3_moe); one only")
    ap.add_argument("--layouts", default="tp1ep1pp1", help="only tp1ep1pp1: the step is measured on one process")
    ap.add_argument("--calibration-batch", type=int, default=4)
    ap.add_argument("--predicted-batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    try:
        if a.layouts.strip().lower() != "tp1ep1pp1":
            raise ValueError(f"--layouts {a.layouts!r}: this bench measures one process; only tp1ep1pp1 is supported")
        if a.model and len(a.model) > 1:
            raise ValueError(f"--model given {len(a.model)} times: this bench takes one model")
        if a.calibration_batch == a.predicted_batch:
            raise ValueError(f"--predicted-batch {a.predicted_batch} equals --calibration-batch: the prediction must "
                             "be at another batch size")
        for k in ("calibration_batch", "predicted_batch", "prompt_len", "response_len", "rank", "repeats"):
            if getattr(a, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')}={getattr(a, k)}: must be >= 1")
        if a.model:
            from pathlib import Path

            from ..plan.specs import load_model

            if not Path(a.model[0]).is_dir():
                raise ValueError(f"--model {a.model[0]!r}: not a checkpoint directory (the bench runs the model)")
            load_model(a.model[0])                       # unsupported configs fail here, before any process
    except ValueError as e:
        print(f"bench plan: error: {e}", file=sys.stderr)
        sys.exit(2)
    if not a.model:
        from ..models import get_model

        a.model = [str(get_model("qwen3_moe", "medium"))]
    result = run(a.model[0], a.calibration_batch, a.predicted_batch, a.prompt_len, a.response_len, a.rank,
                 a.repeats)
    emit(result, a.json)
    return result
