"""r3_ab: the main job with R3 (replay=r3) and without it (replay=off) at the same seeds, side by side in one run,
in a named setting (the main job as it is, or a stress), with every run's curves as a PNG (--png, or OUT/r3_ab.png
with --out): held-out success, train-inference KL, F(2)/F(5), sequences holding a token past ratio 2, the largest
per-sequence log-ratio sum, the KL of each response's first and second half, grad norm, clip fraction, response
length.

    python -m moe_lora_rl.bench r3_ab --json [--model DIR] [--layouts tp1ep1pp1] [--setting stress] [--seeds 0,1]
        [--steps N] [--png FILE] [--out DIR [--reuse]] [-- k=v ...]

--setting: a named set of overrides (SETTINGS below; "default" is the main job as it is; long_w500_*: the long
recipe from its 500-step warm start, 60 steps, held-out every 10 steps on 512 samples). Each seed runs both replay
modes on the same rollout seeds. --out DIR keeps each run in DIR/{r3,off}-s{seed} with its overrides, a checkpoint
every 10 steps and resume=auto (bench/runners/kept_runs.py); --reuse then reads the finished runs back and continues an
unfinished one from its last checkpoint, so the runs of a setting can be made over several sessions. kl_r3 /
kl_off: the train-inference k3 KL of the policy each run trains (R3: the trainer on the rollout's routes; off: the
trainer routing itself), mean over steps and seeds. eval_last2_*: the mean of a run's last two evaluations, mean
over seeds. A run has collapsed (collapsed()) when the mean of its last two evaluations is 0.1 or more below its
start or below its best.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ..rl.metrics import read_jsonl
from .runners import figures
from .emit import emit
from .runners.jobs import check_job, ints, job_layout, job_parser, run_job, split_overrides
from .runners.kept_runs import RESUMABLE, fresh, kept, mismatch, with_warm_start
from .runners.r3_ab_runs import SETTINGS, STEPS, WARM, curve, summarize

def main(argv=None) -> dict:
    argv, extra = split_overrides(argv)
    ap = job_parser("r3_ab", __doc__, "every run")
    ap.add_argument("--setting", default="default", help=f"one of {sorted(SETTINGS)}")
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds; each runs with and without R3")
    ap.add_argument("--steps", type=int, default=None,
                    help="RL steps per run (default: the setting's, 60 for long_w500_*, else the recipe's)")
    ap.add_argument("--png", default=None, help="write the curves here (default: OUT/r3_ab.png with --out)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --out: read the finished runs there, continue an unfinished one from its checkpoint")
    a = ap.parse_args(argv)
    if a.setting not in SETTINGS:
        raise ValueError(f"--setting={a.setting!r} is not one of {sorted(SETTINGS)}")
    seeds = ints(a.seeds, "--seeds")
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds={a.seeds!r}: expected distinct seeds >= 0")
    own = [o for o in extra if o.split("=", 1)[0].lstrip("+") in ("replay", "seed", "out_dir", "steps", "model.path",
                                                                  "resume", "checkpoint_every")
           or o.lstrip("+").startswith("layout.")]
    if own:
        raise ValueError(f"override {own[0]!r}: r3_ab sets replay, seed, out_dir, steps, layout.*, model.path, "
                         "resume and checkpoint_every itself (--seeds, --out, --steps, --layouts, --model, --reuse)")
    if a.reuse and not a.out:
        raise ValueError("--reuse reads and continues the runs of --out: give --out DIR")
    lay, layout_over, model_over = job_layout(a, "r3_ab")
    if a.timeout <= 0 or (a.steps is not None and a.steps < 1):
        raise ValueError(f"--steps={a.steps}, --timeout={a.timeout}: must be positive")
    steps = a.steps or STEPS.get(a.setting)
    setting = with_warm_start(SETTINGS[a.setting], WARM.get(a.setting, []), extra, model_over)
    base = [*layout_over, *setting, *extra,
            *model_over, *([f"steps={steps}"] if steps else []), *(RESUMABLE if a.out else [])]

    def job_overrides(replay: str, seed: int) -> list[str]:
        return [*base, f"replay={replay}", f"seed={seed}"]

    for replay in ("r3", "off"):
        check_job(job_overrides(replay, seeds[0]), 2)
    if a.out:                                             # every folder checked before any run starts
        for seed in seeds:
            for replay in ("r3", "off"):
                folder = Path(a.out) / f"{replay}-s{seed}"
                mismatch(folder, job_overrides(replay, seed)) if a.reuse else fresh(folder)
    t0 = time.time()
    runs, curves, how = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        for seed in seeds:
            for replay in ("r3", "off"):
                out = root / f"{replay}-s{seed}"
                runs[replay, seed], how[out.name] = kept(out, job_overrides(replay, seed), a.reuse,
                                                         lambda over, out=out: run_job(2, over, out, a.timeout))
                curves[replay, seed] = curve(read_jsonl(out / "metrics.jsonl"), replay)
        png = Path(a.png) if a.png else (root / "r3_ab.png" if a.out else None)
        if png is not None:
            figures.r3_ab_png(curves, png, f"R3 vs no replay, setting {a.setting!r}, seeds {seeds}")
    out = summarize(runs, seeds)
    out.update({"setting": a.setting, "overrides": [*setting, *extra], "seeds": seeds,
                "steps": runs["r3", seeds[0]]["steps"], "layout": lay.name, "png": str(png) if png else None,
                "reused": sorted(k for k, v in how.items() if v == "reused"),
                "resumed": sorted(k for k, v in how.items() if v == "resumed"),
                "bench_wall_s": round(time.time() - t0, 1)})
    emit(out, a.json)
    return out


