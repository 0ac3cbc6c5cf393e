"""peers: our main job side by side with what users would pick instead, on the same model, task and budget.

    python -m moe_lora_rl.bench peers --json [--model DIR] [--peers ours,ours_async,trl,verl] [--steps 80]
        [--seed 0] [--n-eval 256] [--eval-samples 4] [--task sort|sort_trace]
        [--serving unmerged|merged] [--out DIR]

Every peer trains the default task (8 prompts x 8 samples a step, --steps steps, lr 1e-3, LoRA rank 8 / alpha 16 on
the experts and attention, PPO clip 0.2 / 0.28, token-mean, no KL) from the same HF checkpoint:
  ours        our main job (sync; ours_async: mode=async, max_staleness 1), torchrun on 2 ranks, vLLM rollouts;
  trl         TRL's GRPOTrainer with PEFT (bench/runners/trl_grpo.py) in TRL's environment (.venv-trl, set up on first use);
  verl        verl's main_ppo through our override (recipes/verl_moe_lora/run_cpu_learn.sh).
One evaluator (bench/runners/peer_eval.py: HF + peft, fp32, T=1, the same held-out problems, samples and seeds) measures
the starting checkpoint and each run's final PEFT adapter: eval_<peer>. <peer>_samples_per_s: samples trained over
the training loop's wall time (evaluation excluded; start-up in <peer>_total_s). A peer that is not installed or fails
to start is reported in `errors` with one line; the others still run. --task sort_trace: every peer trains the
written selection sort of 10 digits instead (85-token answers, up to 96 sampled; bench/runners/peer_task.py), from that
task's warm start; verl's recipe trains the default task only and is refused with it.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from .emit import emit

PEERS = ("ours", "ours_async", "trl", "verl")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench peers")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the warm-started default model)")
    ap.add_argument("--peers", default="ours,trl,verl", help=f"comma-separated, of {', '.join(PEERS)}")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-eval", type=int, default=256, help="held-out problems of the one evaluator")
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per held-out problem (T=1)")
    ap.add_argument("--rollout-dtype", default="float32",
                    help="ours' and verl's rollout dtype (float32: the faster on CPUs without bf16 instructions; "
                         "TRL samples from its fp32 trained model)")
    ap.add_argument("--eval-every", type=int, default=20, help="each run's adapter saved and evaluated every N steps")
    ap.add_argument("--target", type=float, default=None,
                    help="held-out success whose loop seconds are reported (default: the start's + 0.1)")
    ap.add_argument("--png", default=None, help="plot held-out success and training reward against loop time here")
    ap.add_argument("--serving", default="unmerged",
                    help="our engine's adapter serving (the main job's `serving`): unmerged (the default) or merged "
                         "(the adapters merged into the base at each push: the faster rollout on long answers)")
    ap.add_argument("--task", default="sort", help="the task every peer trains (bench/runners/peer_task.py): sort (the "
                    "default, 6-token answers) or sort_trace (85-token answers)")
    ap.add_argument("--reuse", action="store_true", help="read the finished runs in --out instead of running them")
    ap.add_argument("--out", default=None, help="directory of the runs (default: a temporary one, removed)")
    a = ap.parse_args(argv)
    names = [n for n in a.peers.split(",") if n]
    bad = [n for n in names if n not in PEERS]
    if bad or not names:
        raise ValueError(f"--peers {a.peers!r}: unknown peer {bad[0] if bad else '(none)'}; "
                         f"choose from {', '.join(PEERS)}")
    if "trl" in names and "ours" not in names:
        raise ValueError("--peers with trl needs ours: TRL trains the LoRA our main job exports "
                         "(its adapter_config.json)")
    for k in ("steps", "n_eval", "eval_samples", "eval_every"):
        if getattr(a, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')}={getattr(a, k)} must be >= 1")
    if a.eval_every > a.steps:
        raise ValueError(f"--eval-every={a.eval_every} is more than --steps={a.steps}")
    if a.target is not None and not 0 < a.target <= 1:
        raise ValueError(f"--target={a.target} must be in (0, 1]")
    if a.reuse and not a.out:
        raise ValueError("--reuse reads the runs of --out DIR: give --out")
    if a.serving not in ("unmerged", "merged"):
        raise ValueError(f"--serving={a.serving!r}: choose unmerged or merged")
    if a.rollout_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--rollout-dtype={a.rollout_dtype!r}: choose float32 or bfloat16")
    if a.model and not Path(a.model).is_dir():
        raise ValueError(f"--model {a.model}: not a directory")
    from .runners.peer_task import peer_task

    task_over = peer_task(a.task)[2]
    if a.task != "sort" and "verl" in names:
        raise ValueError(f"--task={a.task} with verl: its recipe (recipes/verl_moe_lora/run_cpu_learn.sh) trains the "
                         "default task only; leave verl out of --peers")

    from .runners.peer_eval import evaluate
    from .runners.peer_runs import GROUP, PROMPTS, run_ours, run_peers, run_trl, run_verl
    from ..rl import config
    from ..rl.inputs import model_dir

    model = a.model or str(model_dir(config.load(task_over))[0])
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench_peers_"))
    root.mkdir(parents=True, exist_ok=True)
    runners = {
        "ours": lambda: run_ours(root / "ours", a.model, a.steps, a.seed, "sync", a.rollout_dtype, a.reuse,
                                 a.eval_every, a.task, a.serving),
        "ours_async": lambda: run_ours(root / "ours_async", a.model, a.steps, a.seed, "async", a.rollout_dtype,
                                       a.reuse, a.eval_every, a.task, a.serving),
        "trl": lambda: run_trl(root / "trl", model, a.steps, a.seed, root / "ours" / "adapter" / "adapter_config.json",
                              a.reuse, a.eval_every, a.task),
        "verl": lambda: run_verl(root / "verl", a.model, a.steps, a.rollout_dtype, a.reuse, a.eval_every)}
    try:
        results, errors = run_peers(names, runners)

        def ev(adapter):
            return evaluate(model, adapter, n_eval=a.n_eval, samples=a.eval_samples, seed=a.seed,
                            task=a.task)["success"]

        start = ev(None)
        target = a.target if a.target is not None else round(start + 0.1, 3)
        out = {"model": model, "task": a.task, "samples": a.steps * PROMPTS * GROUP, "eval_start": start,
               "target": target}
        curves = {}
        for name in PEERS:
            r = results.get(name)
            out[f"{name}_samples_per_s"] = r["samples"] / r["loop_s"] if r else None
            out[f"{name}_peak_rss_mb"] = r["peak_rss_mb"] if r else None
            if r:                     # [step, loop seconds, held-out success]: the start, each saved adapter
                curves[name] = [[0, 0.0, start]] + [[k, t, ev(d)] for k, t, d in r["points"]]
            out[f"eval_{name}"] = curves[name][-1][2] if r else None
            out[f"{name}_eval_curve"] = curves.get(name)
            out[f"{name}_s_to_target"] = next((t for _, t, e in curves.get(name, []) if e >= target), None)
            if r:
                out[name] = {k: (str(v) if isinstance(v, Path) else v) for k, v in r.items()
                             if k not in ("curve", "points")}
        for name in ("trl", "verl"):
            if out["ours_samples_per_s"] and out[f"{name}_samples_per_s"]:
                out[f"ours_vs_{name}_speed"] = out["ours_samples_per_s"] / out[f"{name}_samples_per_s"]
        out["errors"] = errors
        if a.png:
            from .runners.figures import peers_png

            peers_png(Path(a.png), {n: r["curve"] for n, r in results.items()}, curves, out)
        out["evaluator"] = {"n_eval": a.n_eval, "samples": a.eval_samples, "temperature": 1.0, "dtype": "float32",
                            "by": "HF transformers + peft (merged), moe_lora_rl.bench.runners.peer_eval",
                            "every": a.eval_every}
    finally:
        if not a.out:
            shutil.rmtree(root, ignore_errors=True)
    emit(out, a.json)
    return out
