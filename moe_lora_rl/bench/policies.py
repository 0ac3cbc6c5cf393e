"""policies: two policies trained together on one base and one engine pool (the run config's `policies`,
rl/policies_run.py) against each trained alone, one after the other, on the same cores, side by side in one run.

    python -m moe_lora_rl.bench policies --json [--model DIR] [--layouts tp1ep1pp1] [--steps 20] [--seeds 1,2]
        [--lrs 1e-3,1e-3] [--eval-every 10] [--phase-steps 5] [--policies-rollout turns] [--png FILE] [--out DIR] [--timeout S] [-- k=v ...]

Runs, each a whole job under torchrun with 2 ranks: `together` (policies p0 and p1 of the given seeds and learning
rates), then p0 alone and p1 alone (the same settings as a run of one policy), then p0 for --phase-steps steps with
every process on one core (taskset -c 0; evaluation at its start and end only). Figures:
- speedup: the two runs alone one after the other against the run together, in job seconds (process start to
  exit: what a user waits, setup included); speedup_loop: the same in RL-loop seconds (summary wall_s: evaluation
  included, setup left out);
- eval_gap_max: the largest |held-out success together - alone| of a policy at the same step (every --eval-every);
- k3_max: the largest engine-vs-trainer k3 of any step of either policy in the run together (with fp32 rollouts
  ~1e-12: each request served with its own policy's version);
- peak_rss_together_mb against peak_rss_apart_mb (the two runs alone held at once: the sum of their peaks) and
  peak_rss_alone_max_mb, each the peak RSS of everything the job started.
- predicted_speedup, predicted_speedup_loop: plan/shared_host.py's predict_policies from phase figures measured
  here (rollout and train seconds per step on all cores from p0 alone, on one core from the one-core run, setup
  and evaluation seconds from p0 alone), beside the measured.
--model, --layouts and the overrides after `--` reach every run.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from ..plan.shared_host import HostPhases, predict_policies
from .emit import emit
from .runners.jobs import check_job, job_layout, job_parser, phases, run_job, split_overrides

NAMES = ("p0", "p1")


def _pair(text: str, what: str, kind):
    try:
        out = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected two comma-separated {kind.__name__}s") from None
    if len(out) != 2:
        raise ValueError(f"{what}={text!r}: expected two values (one per policy), got {len(out)}")
    return out


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _evals(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["eval"] for r in rows if "eval" in r}


def main(argv=None) -> dict:
    from .runners.peak_rss import PeakChildrenRss

    argv, extra = split_overrides(argv)
    ap = job_parser("policies", __doc__, "every run")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", default="1,2", help="the two policies' seeds")
    ap.add_argument("--lrs", default="1e-3,1e-3", help="the two policies' learning rates")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--phase-steps", type=int, default=5, help="steps of the one-core run (the planner's phases)")
    ap.add_argument("--policies-rollout", default="turns", choices=("turns", "batched"),
                    help="how the run together generates (the run config's policies_rollout)")
    ap.add_argument("--png", default=None, help="plot each policy's held-out success together and alone here")
    a = ap.parse_args(argv)
    lay, layout_over, model_over = job_layout(a, "policies")
    seeds, lrs = _pair(a.seeds, "--seeds", int), _pair(a.lrs, "--lrs", float)
    if a.steps < 1 or a.phase_steps < 1 or a.eval_every < 0 or a.timeout <= 0:
        raise ValueError(f"--steps={a.steps}, --phase-steps={a.phase_steps}, --eval-every={a.eval_every}, "
                         f"--timeout={a.timeout}: steps and timeout must be > 0, eval-every >= 0")
    if seeds[0] == seeds[1] and lrs[0] == lrs[1]:
        raise ValueError(f"--seeds={a.seeds} --lrs={a.lrs}: the two policies would be the same run")
    base = [*layout_over, f"steps={a.steps}", f"eval_every={a.eval_every}", *model_over, *extra]
    pols = ", ".join(f"{{name: {n}, seed: {s}, lr: {lr!r}}}" for n, s, lr in zip(NAMES, seeds, lrs))
    together = [*base, f"policies=[{pols}]", f"policies_rollout={a.policies_rollout}"]
    alone = {n: [*base, f"seed={s}", f"algo.lr={lr!r}"] for n, s, lr in zip(NAMES, seeds, lrs)}
    for over in (together, *alone.values()):
        check_job(over, 2)
    t_bench = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        wall, peak, summ = {}, {}, {}
        for name, over in (("together", together), *alone.items()):
            t0 = time.perf_counter()
            with PeakChildrenRss() as rss:
                summ[name] = run_job(2, over, root / name, a.timeout)
            wall[name], peak[name] = time.perf_counter() - t0, rss.mb
        one_core = run_job(2, [*alone[NAMES[0]], f"steps={a.phase_steps}", "eval_every=0"], root / "one-core",
                           a.timeout, prefix=("taskset", "-c", "0"))
        rows_t = {n: _rows(root / "together" / n / "metrics.jsonl") for n in NAMES}
        rows_a = {n: _rows(root / n / "metrics.jsonl") for n in NAMES}
    gaps = {n: {s: abs(e - _evals(rows_a[n])[s]) for s, e in _evals(rows_t[n]).items() if s in _evals(rows_a[n])}
            for n in NAMES}
    per = {n: {"seed": s, "lr": lr, "eval_together": _evals(rows_t[n]), "eval_alone": _evals(rows_a[n]),
               "k3_max": max(r["update_rollout_kl"] for r in rows_t[n] if "update_rollout_kl" in r),
               "same_samples_steps": sum(x.get("samples_sha256") == y.get("samples_sha256")
                                         for x, y in zip(rows_t[n], rows_a[n]) if x["step"] >= 1)}
           for n, s, lr in zip(NAMES, seeds, lrs)}
    apart = sum(wall[n] for n in NAMES)
    (r1, t1), (rc, tc) = phases(one_core), phases(summ[NAMES[0]])
    s0 = summ[NAMES[0]]
    pred = predict_policies(HostPhases(rollout_1=r1, rollout_c=rc, train_1=t1, train_c=tc,
                                       cores=len(os.sched_getaffinity(0))), len(NAMES), a.steps,
                            setup_s=wall[NAMES[0]] - s0["wall_s"], eval_s=s0["eval_s"])
    out = {"speedup": apart / wall["together"],
           "speedup_loop": sum(summ[n]["wall_s"] for n in NAMES) / summ["together"]["wall_s"],
           "eval_gap_max": max(g for n in NAMES for g in gaps[n].values()),
           "k3_max": max(p["k3_max"] for p in per.values()),
           "peak_rss_together_mb": peak["together"], "peak_rss_apart_mb": sum(peak[n] for n in NAMES),
           "peak_rss_alone_max_mb": max(peak[n] for n in NAMES),
           "job_s_together": wall["together"], "job_s_apart": apart, "job_s": {n: wall[n] for n in NAMES},
           "loop_s_together": summ["together"]["wall_s"], "loop_s": {n: summ[n]["wall_s"] for n in NAMES},
           "predicted_speedup": pred["predicted_speedup"], "predicted_speedup_loop": pred["predicted_speedup_loop"],
           "predicted_turn_s": pred["turn_s"], "predicted_limit": pred["limit"],
           "phases_s_per_step": {"rollout_1": r1, "rollout_c": rc, "train_1": t1, "train_c": tc},
           "policies": per, "policies_rollout": a.policies_rollout, "steps": a.steps, "layout": lay.name, "bench_wall_s": round(time.time() - t_bench, 1)}
    if a.png:
        from .runners.figures import policies_png

        policies_png(Path(a.png), out)
    emit(out, a.json)
    return out
