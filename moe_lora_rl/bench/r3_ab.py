"""r3_ab: the main job with R3 (replay=r3) and without it (replay=off) at the same seeds, side by side in one run,
in a named setting (the main job as it is, or a stress), with the held-out success, train-inference KL, grad norm
and clip fraction curves as a PNG (--png, or OUT/r3_ab.png with --out).

    python -m moe_lora_rl.bench r3_ab --json [--model DIR] [--layouts tp1ep1pp1] [--setting stress] [--seeds 0,1]
        [--steps N] [--png FILE] [--out DIR] [-- k=v ...]

--setting: a named set of overrides (SETTINGS below; "default" is the main job as it is). Each seed runs both
replay modes on the same rollouts seeds. kl_r3 / kl_off: the train-inference k3 KL of the policy each run trains
(R3: the trainer on the rollout's routes; off: the trainer routing itself), mean over steps and seeds. A run has
collapsed when its final held-out success is below its start, or fell by more than 0.1 from its best.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ..rl.metrics import read_jsonl
from .async_rl import _ints
from . import figures
from .common import emit
from .e2e import _preflight, job_layout, job_parser, run_job, split_overrides

SETTINGS = {
    "default": [],
    "lr3e-3_no_is": ["algo.lr=3e-3", "algo.rollout_is=off"],
    "lr1e-2_no_is": ["algo.lr=1e-2", "algo.rollout_is=off"],
    "bf16_no_is": ["runtime.train_dtype=bfloat16", "algo.rollout_is=off"],
    "mini4_no_is": ["algo.mini_batches=4", "algo.rollout_is=off"],
    "long": ["--config-name=long", "algo.mini_batches=4", "algo.rollout_is=off"],
    "medium": ["--config-name=long", "data.mix=medium", "data.eval_samples=2", "algo.max_response_tokens=160",
               "algo.mini_batches=4", "algo.rollout_is=off"],
    "long_lr3e-3": ["--config-name=long", "algo.mini_batches=4", "algo.rollout_is=off", "algo.lr=3e-3"],
    "long_async": ["--config-name=long", "algo.mini_batches=4", "algo.rollout_is=off", "mode=async",
                   "max_staleness=2"],
}
"""Named settings: hydra overrides added to both replay modes. default: the main job as it is; lr*/bf16*: the
stresses tried on it (README, "What R3 changes"): a larger learning rate, or Megatron in bf16 too, without the
rollout correction; mini4_no_is: four mini-steps per rollout batch (the LFM report's setting) without it. long*:
the long-reasoning job (recipes/long.yaml) where the literature sees runs without R3 collapse: several mini-steps
per rollout (4), no truncated IS, bf16 rollouts at temperature 1; with a larger
learning rate, or asynchronous with a staleness bound of 2; medium: the same on data.mix=medium (6-14 digits,
40-150 tokens), where the warm-started model succeeds often enough for GRPO to learn."""
CURVES = (("Held-out success", ("eval",)), ("Train-inference KL (k3)", ("kl",)),
          ("Tokens with ratio > 2 (solid) / > 5 (dotted)", ("f2", "f5")), ("Grad norm", ("grad_norm",)),
          ("Clip fraction", ("pg_clipfrac",)), ("Response length (tokens)", ("response_len",)))


def collapsed(evals: dict) -> bool:
    vals = [evals[k] for k in sorted(evals, key=int)]
    return vals[-1] < vals[0] or max(vals) - vals[-1] > 0.1


def curve(records: list[dict], replay: str) -> list[dict]:
    """Per step: held-out success (where evaluated), the trained policy's KL and F(2), F(5) (R3: the trainer on the
    rollout's routes; off: routing itself), grad norm, clip fraction and mean response length."""
    pre = "r3_" if replay == "r3" else "no_r3_"
    names = {"kl": pre + "kl", "f2": pre + "ratio_gt2", "f5": pre + "ratio_gt5", "grad_norm": "grad_norm",
             "pg_clipfrac": "pg_clipfrac", "response_len": "response_len"}
    return [{"step": r["step"], **({"eval": r["eval"]} if "eval" in r else {}),
             **{k: r[src] for k, src in names.items() if src in r}} for r in records]


def plot(curves: dict, png: Path, title: str) -> Path:
    fig, axes = figures.panels(3, 2, size=(10, 10))
    first = min(s for _, s in curves)
    for ax, (name, keys) in zip(axes, CURVES):
        for key, dotted in zip(keys, (False, True)):
            for (replay, seed), rows in sorted(curves.items()):
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color="C0" if replay == "r3" else "C3",
                            ls=":" if dotted else "-" if seed == first else "--",
                            marker="o" if key == "eval" else None, ms=3,
                            label=None if dotted else f"{replay} seed {seed}")
        figures.style(ax, name, log=keys[0] == "kl")
    return figures.save(fig, title, png)


def main(argv=None) -> dict:
    argv, extra = split_overrides(argv)
    ap = job_parser("r3_ab", __doc__, "every run")
    ap.add_argument("--setting", default="default", help=f"one of {sorted(SETTINGS)}")
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds; each runs with and without R3")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the recipe's)")
    ap.add_argument("--png", default=None, help="write the curves here (default: OUT/r3_ab.png with --out)")
    a = ap.parse_args(argv)
    if a.setting not in SETTINGS:
        raise ValueError(f"--setting={a.setting!r} is not one of {sorted(SETTINGS)}")
    seeds = _ints(a.seeds, "--seeds")
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds={a.seeds!r}: expected distinct seeds >= 0")
    own = [o for o in extra if o.split("=", 1)[0].lstrip("+") in ("replay", "seed", "out_dir", "steps", "model.path")
           or o.lstrip("+").startswith("layout.")]
    if own:
        raise ValueError(f"override {own[0]!r}: r3_ab sets replay, seed, out_dir, steps, layout.* and model.path "
                         "itself (--seeds, --out, --steps, --layouts, --model)")
    lay, layout_over, model_over = job_layout(a, "r3_ab")
    if a.timeout <= 0 or (a.steps is not None and a.steps < 1):
        raise ValueError(f"--steps={a.steps}, --timeout={a.timeout}: must be positive")
    base = [*layout_over, *SETTINGS[a.setting], *extra, *model_over, *([f"steps={a.steps}"] if a.steps else [])]
    for replay in ("r3", "off"):
        _preflight([*base, f"replay={replay}"], 2)
    t0 = time.time()
    runs, curves = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        for seed in seeds:
            for replay in ("r3", "off"):
                out = root / f"{replay}-s{seed}"
                runs[replay, seed] = run_job(2, [*base, f"replay={replay}", f"seed={seed}"], out, a.timeout)
                curves[replay, seed] = curve(read_jsonl(out / "metrics.jsonl"), replay)
        png = Path(a.png) if a.png else (root / "r3_ab.png" if a.out else None)
        if png is not None:
            plot(curves, png, f"R3 vs no replay, setting {a.setting!r}, seeds {seeds}")

    def mean(replay, key):
        return sum(runs[replay, s][key] for s in seeds) / len(seeds)

    out = {"eval_start": mean("r3", "eval_start"), "eval_end_r3": mean("r3", "eval_end"),
           "eval_end_off": mean("off", "eval_end"), "kl_r3": mean("r3", "kl_mean_r3"),
           "kl_off": mean("off", "kl_mean_no_r3"), "ratio_gt2_r3": mean("r3", "ratio_gt2"),
           "ratio_gt2_off": mean("off", "ratio_gt2_no_r3"), "ratio_gt5_r3": mean("r3", "ratio_gt5"),
           "ratio_gt5_off": mean("off", "ratio_gt5_no_r3"), "seq_ratio_gt2_r3": mean("r3", "seq_ratio_gt2_r3"),
           "seq_ratio_gt2_off": mean("off", "seq_ratio_gt2_no_r3"),
           "kl_halves_off": [mean("off", "kl_first_half_no_r3"), mean("off", "kl_second_half_no_r3")],
           "response_len_r3": mean("r3", "response_len_mean"), "response_len_off": mean("off", "response_len_mean"),
           "grad_norm_r3": mean("r3", "grad_norm_mean"),
           "grad_norm_off": mean("off", "grad_norm_mean"), "clipfrac_r3": mean("r3", "clipfrac_mean"),
           "clipfrac_off": mean("off", "clipfrac_mean"),
           "collapsed_r3": sum(collapsed(runs["r3", s]["evals"]) for s in seeds),
           "collapsed_off": sum(collapsed(runs["off", s]["evals"]) for s in seeds),
           "evals": {f"{r}-s{s}": runs[r, s]["evals"] for r, s in sorted(runs)},
           "setting": a.setting, "overrides": SETTINGS[a.setting] + extra, "seeds": seeds,
           "steps": runs["r3", seeds[0]]["steps"], "layout": lay.name, "png": str(png) if png else None,
           "bench_wall_s": round(time.time() - t0, 1)}
    emit(out, a.json)
    return out
