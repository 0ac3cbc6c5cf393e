"""peers: our main job side by side with what users would pick instead, on the same model, task and budget.

    python -m moe_lora_rl.bench peers --json [--model DIR] [--peers ours,ours_async,trl,verl] [--steps 80]
        [--seed 0] [--n-eval 256] [--eval-samples 4] [--out DIR]

Every peer trains the default task (8 prompts x 8 samples a step, --steps steps, lr 1e-3, LoRA rank 8 / alpha 16 on
the experts and attention, PPO clip 0.2 / 0.28, token-mean, no KL) from the same HF checkpoint:
  ours        our main job (sync; ours_async: mode=async, max_staleness 1), torchrun on 2 ranks, vLLM rollouts;
  trl         TRL's GRPOTrainer with PEFT (checks/trl_grpo.py) in TRL's environment (.venv-trl, set up on first use);
  verl        verl's main_ppo through our override (recipes/verl_moe_lora/run_cpu_learn.sh).
One evaluator (checks/peer_eval.py: HF + peft, fp32, T=1, the same held-out problems, samples and seeds) measures
the starting checkpoint and each run's final PEFT adapter: eval_<peer>. <peer>_samples_per_s: samples trained over
the training loop's wall time (evaluation excluded; start-up in <peer>_total_s). A peer that is not installed or fails
to start is reported in `errors` with one line; the others still run.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .common import emit

PEERS = ("ours", "ours_async", "trl", "verl")
PROMPTS, GROUP = 8, 8


class PeerFailed(RuntimeError):
    """One line: which peer and why."""


def run_ours(out: Path, model: str | None, steps: int, seed: int, mode: str, rollout_dtype: str,
             reuse: bool) -> dict:
    from ..checks.train_runs import finish_train, start_train

    if not reuse:
        extra = [f"steps={steps}", f"seed={seed}", f"mode={mode}", f"eval_every={steps}",
                 f"runtime.rollout_dtype={rollout_dtype}"]
        if model:
            extra.append(f"model.path={model}")
        t0 = time.perf_counter()
        p = start_train(out, extra)
        try:
            finish_train(p, out, timeout=3600)
        except AssertionError as e:
            raise PeerFailed(f"{out.name}: the main job failed: {str(e).strip().splitlines()[-1][:200]}") from None
        (out / "total_s").write_text(f"{time.perf_counter() - t0:.1f}\n")
    if not (out / "summary.json").exists():
        raise PeerFailed(f"{out.name}: no finished run in {out}")
    summary = json.loads((out / "summary.json").read_text())
    from safetensors import safe_open

    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
        expert = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys() if ".experts." in k)
    return {"adapter": out / "adapter", "samples": summary["steps"] * PROMPTS * GROUP,
            "loop_s": summary["wall_s"] - summary["eval_s"], "total_s": float((out / "total_s").read_text()),
            "own_eval_end": summary["eval_end"], "curve": _ours_curve(out),
            "bytes_per_step": summary["refit_bytes_per_step"], "trainable_params": params,
            "trainable_expert_params": expert,
            "time_split_s": {"rollout": summary["rollout_busy_frac"] * summary["wall_s"],
                             "train": summary["train_busy_frac"] * summary["wall_s"], "eval": summary["eval_s"]},
            "settings": {"mode": summary["mode"], "steps": summary["steps"], "seed": seed,
                         "replay": summary["replay"], "rollout_dtype": rollout_dtype, "serving": summary["serving"],
                         "layout": summary["layout"], "rollout": "vLLM (CPU)"}}


def _ours_curve(out: Path) -> list[list[float]]:
    """[loop seconds, reward] per step: the run's seconds, evaluation left out."""
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [[r["wall_s"] - r["eval_s"], r["reward"]] for r in rows if r["step"] >= 1 and "reward" in r]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run_trl(out: Path, model: str, steps: int, seed: int, lora_config: Path, reuse: bool) -> dict:
    from ..checks.launch import worker_env
    from ..checks.trl_env import PeerUnavailable, ensure

    if not reuse:
        try:
            py = ensure()
        except PeerUnavailable as e:
            raise PeerFailed(str(e)) from None
        t0 = time.perf_counter()
        p = subprocess.run([str(py), "-m", "moe_lora_rl.checks.trl_grpo", "--model", model, "--lora-config",
                            str(lora_config), "--out", str(out), "--steps", str(steps), "--seed", str(seed),
                            "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP)],
                           capture_output=True, text=True, env=worker_env(), timeout=7200)
        if p.returncode != 0:
            why = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise PeerFailed(f"trl: its run failed (rc {p.returncode}): {why[:200]}")
        (out / "total_s").write_text(f"{time.perf_counter() - t0:.1f}\n")
    if not (out / "summary.json").exists():
        raise PeerFailed(f"trl: no finished run in {out}")
    s = json.loads((out / "summary.json").read_text())
    return {"adapter": out / "adapter", "samples": s["samples"], "loop_s": s["wall_s"],
            "total_s": float((out / "total_s").read_text()), "bytes_per_step": 0,
            "versions": s["versions"], "settings": s["settings"],
            "curve": [[sum(s["step_times"][:i + 1]), r] for i, r in enumerate(s["reward_curve"])],
            "trainable_params": s["trainable_params"], "trainable_expert_params": s["trainable_expert_params"]}


def run_verl(out: Path, model: str | None, steps: int, rollout_dtype: str, reuse: bool) -> dict:
    from ..checks.verl_runs import run

    overrides = [f"actor_rollout_ref.rollout.dtype={rollout_dtype}", f"trainer.save_freq={steps}",
                 f"trainer.default_local_dir={out / 'ckpt'}"]
    try:
        r = run(out, overrides, steps=steps, test_freq=steps, model=model, reuse=reuse)
    except RuntimeError as e:
        raise PeerFailed(f"verl: {str(e).splitlines()[0][:200]}") from None
    from importlib.metadata import version

    val, t = r["val"], r["timing"]
    if "step" not in t:
        raise PeerFailed(f"verl: {out / 'run.log'} logs no timing_s/step")
    return {"adapter": _verl_adapter(out, model), "checkpoint": str(_last_checkpoint(out / "ckpt")),
            "samples": r["steps"] * PROMPTS * GROUP, "loop_s": t["step"], "total_s": r["wall_s"],
            "time_split_s": {k: t[k] for k in ("gen", "old_log_prob", "update_actor", "update_weights", "testing")
                             if k in t},
            "curve": [[sum(c[1] for c in r["curve"][:i + 1]), c[2]] for i, c in enumerate(r["curve"])],
            "own_eval_start": val.get(0), "own_eval_end": val.get(max(val)) if val else None,
            "versions": {"verl": version("verl")},
            "settings": {"script": "recipes/verl_moe_lora/run_cpu_learn.sh", "steps": steps,
                         "rollout_dtype": rollout_dtype,
                         "own_eval": "verl's validation, greedy, 256 problems",
                         "loop_s": "the sum of verl's timing_s/step (start-up and validations in total_s)"}}


def _last_checkpoint(root: Path) -> Path:
    """The step directory our engine saved at verl's last save (root/global_step_N/actor/step-N)."""
    found = sorted(root.glob("global_step_*/actor/step-*/manifest.json"),
                   key=lambda f: int(f.parts[-4].removeprefix("global_step_")))
    if not found:
        raise PeerFailed(f"verl: no checkpoint of our engine under {root} (trainer.save_freq)")
    return found[-1].parent


def _verl_adapter(out: Path, model: str | None) -> Path:
    """verl's final adapters as a PEFT adapter (refit/export.checkpoint_to_peft), for the one evaluator."""
    from ..refit.export import checkpoint_to_peft

    if not (out / "adapter" / "adapter_model.safetensors").exists():
        from ..rl.config import TrainConfig
        from ..rl.inputs import model_dir

        checkpoint_to_peft(_last_checkpoint(out / "ckpt"), model or model_dir(TrainConfig())[0], out / "adapter")
    return out / "adapter"


def run_peers(names, runners: dict) -> tuple[dict, dict]:
    """Each named peer's result, and {peer: one line} for those that failed; a failure stops that peer alone."""
    from ..checks.peak_rss import PeakChildrenRss

    results, errors = {}, {}
    for name in names:
        try:
            with PeakChildrenRss() as peak:
                results[name] = runners[name]()
            results[name]["peak_rss_mb"] = peak.mb or None          # None: a reused run, not measured
        except PeerFailed as e:
            errors[name] = str(e)
    return results, errors


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
    ap.add_argument("--png", default=None, help="plot each run's training reward against its loop time here")
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
    for k in ("steps", "n_eval", "eval_samples"):
        if getattr(a, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')}={getattr(a, k)} must be >= 1")
    if a.reuse and not a.out:
        raise ValueError("--reuse reads the runs of --out DIR: give --out")
    if a.rollout_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--rollout-dtype={a.rollout_dtype!r}: choose float32 or bfloat16")
    if a.model and not Path(a.model).is_dir():
        raise ValueError(f"--model {a.model}: not a directory")

    from ..checks.peer_eval import evaluate
    from ..rl.config import TrainConfig
    from ..rl.inputs import model_dir

    model = a.model or str(model_dir(TrainConfig())[0])
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench_peers_"))
    root.mkdir(parents=True, exist_ok=True)
    runners = {
        "ours": lambda: run_ours(root / "ours", a.model, a.steps, a.seed, "sync", a.rollout_dtype, a.reuse),
        "ours_async": lambda: run_ours(root / "ours_async", a.model, a.steps, a.seed, "async", a.rollout_dtype,
                                       a.reuse),
        "trl": lambda: run_trl(root / "trl", model, a.steps, a.seed, root / "ours" / "adapter" / "adapter_config.json",
                              a.reuse),
        "verl": lambda: run_verl(root / "verl", a.model, a.steps, a.rollout_dtype, a.reuse)}
    try:
        results, errors = run_peers(names, runners)

        def ev(adapter):
            return evaluate(model, adapter, n_eval=a.n_eval, samples=a.eval_samples, seed=a.seed)["success"]

        out = {"model": model, "samples": a.steps * PROMPTS * GROUP, "eval_start": ev(None)}
        for name in PEERS:
            r = results.get(name)
            out[f"{name}_samples_per_s"] = r["samples"] / r["loop_s"] if r else None
            out[f"{name}_peak_rss_mb"] = r["peak_rss_mb"] if r else None
            out[f"eval_{name}"] = ev(r["adapter"]) if r and r["adapter"] is not None else None
            if r:
                out[name] = {k: (str(v) if isinstance(v, Path) else v) for k, v in r.items() if k != "curve"}
        for name in ("trl", "verl"):
            if out["ours_samples_per_s"] and out[f"{name}_samples_per_s"]:
                out[f"ours_vs_{name}_speed"] = out["ours_samples_per_s"] / out[f"{name}_samples_per_s"]
        out["errors"] = errors
        if a.png:
            from .figures import peers_png

            peers_png(Path(a.png), {n: r["curve"] for n, r in results.items()}, out)
        out["evaluator"] = {"n_eval": a.n_eval, "samples": a.eval_samples, "temperature": 1.0, "dtype": "float32",
                            "by": "HF transformers + peft (merged), moe_lora_rl.peers.evaluate"}
    finally:
        if not a.out:
            shutil.rmtree(root, ignore_errors=True)
    emit(out, a.json)
    return out
