"""sparse: Sparse-RL on the long task (sort_trace: the written selection sort of 10 digits, ~85 response tokens) with
the rollouts sampled on a compressed KV cache. Per seed, three runs at the same seeds: dense (KV uncompressed, the
main job's truncated IS), sparse_uncorrected (the same engine on a `--budget`-token window, no rollout correction),
sparse_corrected (the window with Sparse-RL's rejection and reweighting, algo.rollout_is=sparse); with --method
snapkv a fourth, sparse_replay (the trainer replays the eviction, rollout.kv_replay, with the corrections on); then
the KV memory itself, measured by the engine's allocator at a fixed pool (bench/workers/sparse_kv_worker.py).

    python -m moe_lora_rl.bench sparse --json [--model DIR] [--layouts tp1ep1pp1] [--seeds 0,1] [--steps N]
        [--method window|snapkv] [--budget 32] [--evict recent=16,interval=8] [--setting sort_trace|long]
        [--kv-only] [--kv-requests 128] [--pool-blocks 48] [--png FILE] [--runs R,...] [--out DIR [--reuse]]
        [-- k=v ...]

--method snapkv: importance-based eviction (vllm/kv_evict.py) with --evict's settings (rollout.kv_evict.*: sinks,
recent, window, interval, pool). --setting long: the long-reasoning job (recipes/long.yaml: answers of ~60-400
tokens) instead of sort_trace, from its 500-step warm start at lr 3e-4 (WARM); the KV worker then forces answers of
algo.max_response_tokens. --kv-only: the KV measurement alone, no learning run.

Held-out success (eval_*): the trained adapter on a dense engine (summary eval_end_dense; for the dense run its own
final evaluation), mean over seeds; eval_*_sampler: the same problems under each run's own sampler. kv_bytes_ratio:
sparse / dense KV bytes per sequence at the same concurrency (the runs' batches, every sequence of a step running at
once), at its peak per sequence (what a sequence must be given room for); kv_bytes_ratio_mean: time-averaged over
engine steps. concurrency_ratio: the most sequences the sparse engine serves at once without a preemption over the dense engine's,
on the same KV pool (--pool-blocks) and requests (bench/workers/sparse_kv_worker.py). rejection_rate: sequences rejected by the corrected run, mean over steps.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ..mismatch import LOW_TAIL_KEYS
from ..rl.metrics import read_jsonl
from .runners import figures
from .emit import emit
from .runners.jobs import check_job, ints, job_layout, job_parser, run_job, split_overrides
from .runners.kept_runs import kept, mismatch
from .runners.sparse_runs import (REPLAYS, SETTINGS, evict_spec, kv_figures, kv_summary, mean_of, partial_summary,
                                  pick_runs, run_overrides, runs_of, setting_overrides)

def main(argv=None) -> dict:
    argv, extra = split_overrides(argv)
    ap = job_parser("sparse", __doc__, "every run")
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds; each runs the three modes")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default 30)")
    ap.add_argument("--method", default="window", help="KV compression method (rollout/kv_compression.py)")
    ap.add_argument("--budget", type=int, default=32, help="KV budget in tokens (window: its length)")
    ap.add_argument("--evict", default="", help="snapkv's settings, k=v,... (sinks, recent, window, interval, pool)")
    ap.add_argument("--setting", default="sort_trace", help=f"the task: one of {sorted(SETTINGS)}")
    ap.add_argument("--kv-only", action="store_true", help="the KV memory measurement alone (no learning runs)")
    ap.add_argument("--kv-requests", type=int, default=128, help="requests of each KV measurement run")
    ap.add_argument("--pool-blocks", type=int, default=48, help="KV blocks of the concurrency measurement's pool")
    ap.add_argument("--png", default=None, help="write the curves here (default: OUT/sparse.png with --out)")
    ap.add_argument("--runs", default=None,
                    help="comma-separated runs to run (default: every run of --method); the others are read from "
                         "--out with --reuse, or left out of the summary; with --out, too few for a summary (dense "
                         "and a sparse run) prints the runs done and those missing")
    ap.add_argument("--reuse", action="store_true",
                    help="with --out: a run whose summary.json is already there is read, not run again")
    a = ap.parse_args(argv)
    from ..rollout.kv_compression import METHODS

    if a.method not in METHODS or a.method == "none":
        raise ValueError(f"--method={a.method!r}: choose a compression method of {METHODS[1:]}")
    if a.setting not in SETTINGS:
        raise ValueError(f"--setting={a.setting!r}: choose one of {sorted(SETTINGS)}")
    evict = evict_spec(a.evict)
    if evict and a.method != "snapkv":
        raise ValueError(f"--evict={a.evict!r} applies to --method snapkv, not {a.method!r}")
    seeds = ints(a.seeds, "--seeds")
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds={a.seeds!r}: expected distinct seeds >= 0")
    own = [o for o in extra if o.split("=", 1)[0].lstrip("+") in ("seed", "out_dir", "steps", "model.path")
           or o.lstrip("+").split(".", 1)[0] in ("layout",) or o.lstrip("+").startswith(("rollout.kv_", "algo.rollout_is"))]
    if own:
        raise ValueError(f"override {own[0]!r}: sparse sets seed, out_dir, steps, layout.*, model.path, "
                         "rollout.kv_* and algo.rollout_is itself (--seeds, --out, --steps, --layouts, --model, "
                         "--method, --budget)")
    if a.reuse and not a.out:
        raise ValueError("--reuse reads the runs of --out: give --out DIR")
    if a.timeout <= 0 or (a.steps is not None and a.steps < 1) or a.pool_blocks < 4 or a.kv_requests < 1:
        raise ValueError(f"--steps={a.steps}, --timeout={a.timeout}, --pool-blocks={a.pool_blocks}, --kv-requests="
                         f"{a.kv_requests}: must be positive (pool >= 4)")
    lay, layout_over, model_over = job_layout(a, "sparse")
    base = [*layout_over, *setting_overrides(a.setting, extra, model_over), *extra, *model_over,
            *([f"steps={a.steps}"] if a.steps else [])]
    runs = runs_of(a.method)
    chosen = pick_runs(a.runs, runs)
    cfgs = {run: check_job([*base, *run_overrides(run, a.method, a.budget, evict)], 2) for run in runs}
    cfg = cfgs["dense"]                                   # every run refused up front; the KV figures use dense's
    have = [r for r in runs if r in chosen or (a.reuse and all(
        (Path(a.out) / f"{r}-s{s}" / "summary.json").is_file() for s in seeds))]
    def job_overrides(run: str, seed: int) -> list[str]:
        return [*base, *run_overrides(run, a.method, a.budget, evict), f"seed={seed}"]

    if a.reuse:
        for seed in seeds:
            for run in runs:
                mismatch(Path(a.out) / f"{run}-s{seed}", job_overrides(run, seed))
    partial = "dense" not in have or len(have) < 2        # with --out: the runs alone, the summary once all are there
    if partial and not a.out:
        raise ValueError(f"--runs={a.runs!r}: the summary needs the dense run and a sparse one of every seed {seeds}, "
                         f"run here or read from --out with --reuse (found {have}); with --out DIR the chosen runs "
                         "are kept there for a later --reuse")
    if a.kv_only and a.reuse:
        raise ValueError("--kv-only runs no learning run: --reuse has nothing to read")
    t0 = time.time()
    sums, hist = {}, {}
    if a.kv_only:
        from ..rl.inputs import model_dir

        model = str(model_dir(cfg)[0])
        with tempfile.TemporaryDirectory() as tmp:
            out = {"method": a.method, "budget": a.budget, "evict": evict, "setting": a.setting,
                   **kv_summary(kv_figures(model, a, evict, cfg, Path(a.out or tmp))),
                   "bench_wall_s": round(time.time() - t0, 1)}
        emit(out, a.json)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        reused = []
        for seed in seeds:
            for run in runs:
                out = root / f"{run}-s{seed}"
                if run not in chosen and not (a.reuse and (out / "summary.json").is_file()):
                    continue
                sums[run, seed], how = kept(out, job_overrides(run, seed), a.reuse,
                                            lambda over, out=out: run_job(2, over, out, a.timeout))
                if how == "reused":
                    reused.append(out.name)
                hist[run, seed] = read_jsonl(out / "metrics.jsonl")
        if partial:
            out = partial_summary(sums, a, seeds, runs, time.time() - t0)
            emit(out, a.json)
            return out
        runs = tuple(r for r in runs if all((r, s) in sums for s in seeds))     # those of every seed
        kv = kv_figures(sums["dense", seeds[0]]["model"], a, evict, cfg, root)
        png = Path(a.png) if a.png else (root / "sparse.png" if a.out else None)
        if png is not None:
            figures.sparse_png({k: (hist[k], sums[k].get("eval_end_dense")) for k in hist}, png,
                 f"Sparse-RL on {a.setting}: {a.method} {a.budget} tokens, seeds {seeds}")

    def mean(run, key):                                    # None: a run not run here nor read from --out
        vals = [sums[run, s].get(key) for s in seeds] if run in runs else [None]
        return None if None in vals else sum(vals) / len(vals)

    def hmean(run, key):
        vals = [mean_of(hist[run, s], key) for s in seeds] if run in runs else [None]
        return None if None in vals else sum(vals) / len(vals)

    sp = next(r for r in ("sparse_corrected", "sparse_replay", "sparse_uncorrected") if r in runs)   # the same engine
    dense_end = {s: sums["dense", s]["eval_end"] for s in seeds}
    out = {"method": a.method, "budget": a.budget, "evict": evict, "setting": a.setting, "runs": list(runs),
           "kv_bytes_ratio": hmean(sp, "kv_peak_bytes_per_seq") / hmean("dense", "kv_peak_bytes_per_seq"),
           "kv_bytes_ratio_mean": hmean(sp, "kv_bytes_per_seq") / hmean("dense", "kv_bytes_per_seq"),
           "kv_peak_bytes_per_seq_dense": hmean("dense", "kv_peak_bytes_per_seq"),
           "kv_peak_bytes_per_seq_sparse": hmean(sp, "kv_peak_bytes_per_seq"),
           **kv_summary(kv),
           "eval_start": mean("dense", "eval_start"),
           "eval_dense": sum(dense_end.values()) / len(seeds),
           "eval_sparse_uncorrected": mean("sparse_uncorrected", "eval_end_dense"),
           "eval_sparse_corrected": mean("sparse_corrected", "eval_end_dense"),
           "eval_sparse_uncorrected_sampler": mean("sparse_uncorrected", "eval_end"),
           "eval_sparse_corrected_sampler": mean("sparse_corrected", "eval_end"),
           **({"eval_sparse_replay": mean("sparse_replay", "eval_end_dense"),
               "eval_sparse_replay_sampler": mean("sparse_replay", "eval_end"),
               "rejection_rate_replay": hmean("sparse_replay", "sparse/seq_rejected_frac")}
              if a.method in REPLAYS else {}),
           "rejection_rate": hmean("sparse_corrected", "sparse/seq_rejected_frac"),
           "token_masked_frac": hmean("sparse_corrected", "sparse/token_masked_frac"),
           "kl": {run: mean(run, "kl_mean_r3") for run in runs},
           "ratio_gt2": {run: mean(run, "ratio_gt2") for run in runs},
           "ratio_gt5": {run: mean(run, "ratio_gt5") for run in runs},
           **{k: {run: mean(run, k) for run in runs} for k in LOW_TAIL_KEYS},
           "evals": {f"{r}-s{s}": {**sums[r, s]["evals"], "dense_end": sums[r, s].get("eval_end_dense")}
                     for r, s in sorted(sums)},
           "seeds": seeds, "steps": sums["dense", seeds[0]]["steps"], "layout": lay.name,
           "overrides": extra, "reused": reused, "png": str(png) if png else None, "bench_wall_s": round(time.time() - t0, 1)}
    emit(out, a.json)
    return out
