"""async: the main job in mode=async against the best synchronous run on the same cores, side by side in one run,
and the shared-host planner's prediction of the speedup from phase figures measured in the same run.

    python -m moe_lora_rl.bench async --json [--model DIR] [--layouts tp1ep1pp1] [--steps 20] [--seeds 0,1]
        [--sync-nproc 2,1] [--async-nproc 2] [--max-staleness 1] [--inflight switch] [--setting default|long]
        [--engine-threads auto,1] [--out DIR | --from DIR] [-- k=v ...]

Runs, each a whole job under torchrun (evaluation at the start and the end only; its seconds are left out of the
rates, since evaluation is the same work in both modes):
- sync, for each --sync-nproc (trainer ranks; each rank's torch threads = cores / ranks), seed 0: the best of them
  (steps/min) is the synchronous side, "each phase given every core it can use";
- sync with every process pinned to one core (taskset -c 0, the best sync nproc): the one-core phase figures;
- async, seed 0, for each --engine-threads (the engine's torch threads: the placement of the engine beside the
  trainer's ranks on the cores): the best of them is the async side; then, for every further seed, sync (best nproc)
  and async (best engine threads) again (held-out success after the same number of trained samples).
--setting long: the long-reasoning job (recipes/long.yaml: answers of ~60-400 tokens).
steps_per_min = steps * 60 / (wall - evaluation seconds). occupancy_sync / occupancy_async: the engines' sequences
decoded per engine step over the training rollouts; engine_tokens_per_s_*: the tokens they generated over the same
seconds as the rates; engine_step_fit (sync, one_core, async): a decode step's seconds as fixed_s + per_seq_s *
sequences, fitted over each run's engine steps (rollout/kv_meter.step_fit). Phase seconds per step: rollout = rollout busy (generation
and pushes) minus evaluation, train = train busy, from the sync summaries. overlap_bound = (rollout_C + train_C) /
((rollout_1 + train_1) / C): what perfect overlap on C cores could give. predicted_speedup: plan/shared_host.py with
the sync run's answer lengths and occupancy and the one-core run's fitted decode step (run_lengths; predicted_lengths
says what it took; its lognormal: the synchronous occupancy a lognormal of the answers' mean and p90 alone implies);
predicted_speedup_at_occupancy_async: the same at the async run's measured occupancy instead of full slots (what the
planner's full-slot assumption costs); predicted_speedup_one_length: the same without lengths.
trained_tokens_per_min_*: steps/min x answers per step x the trained answers' mean length, and tokens_speedup their
ratio: runs whose policies drift to other lengths (learning differs between the modes) do different work per step;
speedup_by_seed gives both ratios for every seed. --from DIR: run nothing, read the summaries an earlier run kept
under --out DIR (the same arguments). --model, --layouts and the overrides after `--` reach every run.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from .emit import emit
from .runners.jobs import check_job, ints, job_layout, job_parser, phases, rate, run_job, split_overrides
from .runners.plan_model import run_lengths, spec_occupancy


SETTINGS = {"default": [], "long": ["--config-name=long"]}


def _kept_summary(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"--from: {run_dir}/summary.json is missing (was that run made with the same --seeds, "
                         "--sync-nproc and --engine-threads?)") from None


def main(argv=None) -> dict:
    from ..plan.shared_host import HostPhases, predict

    argv, extra = split_overrides(argv)
    ap = job_parser("async", __doc__, "every run")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", default="0,1", help="comma-separated run seeds (the first also measures phases)")
    ap.add_argument("--sync-nproc", default="2,1", help="trainer ranks tried for the synchronous side")
    ap.add_argument("--async-nproc", type=int, default=2, help="trainer ranks of the async runs")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--inflight", default="switch", choices=("switch", "pin"))
    ap.add_argument("--setting", default="default", choices=sorted(SETTINGS),
                    help="default: the main job; long: the long-reasoning job (recipes/long.yaml)")
    ap.add_argument("--engine-threads", default="auto",
                    help="the engine's torch threads tried for the async runs, e.g. auto,1 (auto: every core)")
    ap.add_argument("--from", dest="from_dir", default=None, help="run nothing: the figures from the summaries an "
                    "earlier run with the same arguments kept under its --out DIR")
    a = ap.parse_args(argv)
    if a.from_dir is not None and a.out is not None:
        raise ValueError(f"--from={a.from_dir!r} with --out={a.out!r}: --from reads an earlier run's outputs and runs "
                         "nothing to keep")
    lay, layout_over, model_over = job_layout(a, "async")
    seeds, sync_nproc = ints(a.seeds, "--seeds"), ints(a.sync_nproc, "--sync-nproc")
    engine_threads = [t.strip() for t in a.engine_threads.split(",") if t.strip()]
    if not engine_threads or any(t != "auto" and not (t.isdigit() and int(t) >= 1) for t in engine_threads):
        raise ValueError(f"--engine-threads={a.engine_threads!r}: expected auto or integers >= 1, comma-separated")
    if a.steps < 1 or a.async_nproc < 1 or min(sync_nproc) < 1 or a.timeout <= 0 or a.max_staleness < 1:
        raise ValueError(f"--steps={a.steps}, --async-nproc={a.async_nproc}, --sync-nproc={a.sync_nproc}, "
                         f"--max-staleness={a.max_staleness}, --timeout={a.timeout}: must be >= 1 (positive)")
    cores = len(os.sched_getaffinity(0))
    base = [*SETTINGS[a.setting], *layout_over, f"steps={a.steps}", "eval_every=0", *model_over, *extra]
    asyn = ["mode=async", f"max_staleness={a.max_staleness}", f"inflight={a.inflight}"]
    algo = [check_job([*base, *asyn], n) for n in {*sync_nproc, a.async_nproc}][0].algo
    batch, cap = algo.prompts_per_step * algo.group_size, algo.max_response_tokens
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.from_dir or a.out or tmp)

        def job(name, nproc, over, seed, prefix=()):
            if a.from_dir is not None:
                return _kept_summary(root / f"{name}-s{seed}")
            return run_job(nproc, [*base, *over, f"seed={seed}"], root / f"{name}-s{seed}", a.timeout, prefix)

        tried = {n: job(f"sync-n{n}", n, [], seeds[0]) for n in sync_nproc}
        best_n = max(tried, key=lambda n: rate(tried[n]))
        one_core = job(f"sync1core-n{best_n}", best_n, [], seeds[0], prefix=("taskset", "-c", "0"))
        sync = {seeds[0]: tried[best_n]}
        placed = {t: [] if t == "auto" else [f"rollout.threads={t}"] for t in engine_threads}
        tried_async = {t: job(f"async-t{t}", a.async_nproc, [*asyn, *placed[t]], seeds[0]) for t in engine_threads}
        best_t = max(tried_async, key=lambda t: rate(tried_async[t]))
        runs = {seeds[0]: tried_async[best_t]}
        for s in seeds[1:]:
            sync[s] = job(f"sync-n{best_n}", best_n, [], s)
            runs[s] = job(f"async-t{best_t}", a.async_nproc, [*asyn, *placed[best_t]], s)
    s0, a0 = sync[seeds[0]], runs[seeds[0]]
    (r1, t1), (rc, tc) = phases(one_core), phases(s0)
    host = HostPhases(rollout_1=r1, rollout_c=rc, train_1=t1, train_c=tc, cores=cores)
    lengths = run_lengths(s0, one_core, batch, cap)
    fixed = predict(host, a.max_staleness)
    pred = predict(host, a.max_staleness, lengths) if lengths else fixed
    speedup = rate(a0) / rate(s0)
    def tokens(s):                                   # trained answer tokens per minute
        return rate(s) * batch * s["response_len_mean"]

    def slots(occupancy):                            # a measured occupancy within the planner's range
        return min(max(occupancy, 1.0), batch)

    tokens_sync, tokens_async = tokens(s0), tokens(a0)
    out = {"sync_steps_per_min": rate(s0), "async_steps_per_min": rate(a0), "speedup": speedup,
           "trained_tokens_per_min_sync": tokens_sync, "trained_tokens_per_min_async": tokens_async,
           "tokens_speedup": tokens_async / tokens_sync,
           "response_len_mean_sync": s0["response_len_mean"], "response_len_mean_async": a0["response_len_mean"],
           "speedup_by_seed": {str(s): {"steps": rate(runs[s]) / rate(sync[s]),
                                        "tokens": tokens(runs[s]) / tokens(sync[s])} for s in seeds},
           "eval_sync": s0["eval_end"], "eval_async": a0["eval_end"],
           "eval_by_seed": {str(s): {"sync": sync[s]["eval_end"], "async": runs[s]["eval_end"],
                                     "start": sync[s]["eval_start"]} for s in seeds},
           "samples_trained": a0["samples_trained"], "staleness_max": max(r["staleness_max"] for r in runs.values()),
           "staleness_bound": a.max_staleness, "dropped_frac": a0["dropped_frac"], "ess_mean": a0["ess_mean"],
           "multi_version_frac": a0["multi_version_frac"],
           "occupancy_sync": s0.get("engine_occupancy"), "occupancy_async": a0.get("engine_occupancy"),
           "engine_tokens_per_s_sync": s0.get("engine_tokens", 0) / (s0["wall_s"] - s0["eval_s"]),
           "engine_tokens_per_s_async": a0.get("engine_tokens", 0) / (a0["wall_s"] - a0["eval_s"]),
           "response_len_mean": a0.get("response_len_mean"),
           "engine_step_fit": {"sync": s0.get("engine_step_fit"), "one_core": one_core.get("engine_step_fit"),
                               "async": a0.get("engine_step_fit")},
           "rollout_idle_sync": 1.0 - rc * s0["steps"] / (s0["wall_s"] - s0["eval_s"]),
           "train_idle_sync": 1.0 - tc * s0["steps"] / (s0["wall_s"] - s0["eval_s"]),
           "rollout_idle_async": a0["rollout_idle_frac"], "train_idle_async": a0["train_idle_frac"],
           "overlap_bound": pred["overlap_bound"], "predicted_speedup": pred["predicted_speedup"],
           "predicted_sync_steps_per_min": pred["sync_steps_per_min"],
           "predicted_async_steps_per_min": pred["async_steps_per_min"],
           "prediction_error": abs(pred["predicted_speedup"] - speedup) / speedup, "predicted_limit": pred["limit"],
           "predicted_speedup_one_length": fixed["predicted_speedup"],
           "predicted_speedup_at_occupancy_async": lengths and a0.get("engine_occupancy") and predict(
               host, a.max_staleness, replace(lengths, occupancy_async=slots(a0["engine_occupancy"]))
           )["predicted_speedup"],
           "predicted_lengths": lengths and {
               "mean": lengths.dist.mean, "batch": batch, "decode_fixed": lengths.fixed_frac,
               "engine_frac": lengths.engine_frac, "occupancy_sync": lengths.occupancy,
               "async_rollout_factor": pred["async_rollout_factor"], "lognormal": spec_occupancy(s0, batch, cap)},
           "phases_s_per_step": {"rollout_1": r1, "rollout_c": rc, "train_1": t1, "train_c": tc, "cores": cores},
           "sync_tried": {str(n): rate(s) for n, s in tried.items()}, "sync_nproc": best_n,
           "async_tried_engine_threads": {t: rate(r) for t, r in tried_async.items()}, "engine_threads": best_t,
           "setting": a.setting,
           "async_nproc": a.async_nproc, "inflight": a.inflight, "steps": a.steps, "layout": lay.name,
           "bench_wall_s": round(time.time() - t0, 1)}
    emit(out, a.json)
    return out
