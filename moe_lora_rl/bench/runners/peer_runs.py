"""The runs of bench peers, each read back the same way: our main job (sync or async), TRL's GRPOTrainer with PEFT
in its own environment, verl's main_ppo through our override; the training reward per step against the loop's
seconds, the final adapter as PEFT for the one evaluator, where the time went. A run may be reused from its
directory (reuse=True). A peer that fails raises PeerFailed with one line; run_peers goes on with the others.

    results, errors = run_peers(["ours", "trl"], {"ours": lambda: run_ours(...), "trl": lambda: run_trl(...)})
"""
from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

PROMPTS, GROUP = 8, 8            # the main job's algo.prompts_per_step and algo.group_size: every peer's batch
# our main job's best settings on a 2-core CPU: megatron's grouped experts (grouped GEMMs, not a loop over 128
# experts), one microbatch per rank (32 rows each on 2 data-parallel ranks) and the free-routing diagnostic
# recompute every 10th step instead of every step (TRL and verl compute no such figure)
OURS_SETTINGS = {"runtime.experts": "grouped", "algo.micro_batch_size": 32, "free_routing_every": 10}


class PeerFailed(RuntimeError):
    """One line: which peer and why."""


def run_ours(out: Path, model: str | None, steps: int, seed: int, mode: str, rollout_dtype: str,
             reuse: bool, every: int, task: str = "sort", serving: str = "unmerged") -> dict:
    from .peer_task import peer_task
    from ...checks.train_runs import finish_train, start_train

    if not reuse:
        extra = [*peer_task(task)[2], f"steps={steps}", f"seed={seed}", f"mode={mode}", f"eval_every={steps}",
                 f"runtime.rollout_dtype={rollout_dtype}", f"checkpoint_every={every}",
                 f"serving={serving}", *(f"{k}={v}" for k, v in OURS_SETTINGS.items())]
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
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        expert = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if ".experts." in k)
    loop = summary["wall_s"] - summary["eval_s"]
    return {"adapter": out / "adapter", "samples": summary["steps"] * PROMPTS * GROUP, "loop_s": loop,
            "points": _ours_points(out, summary["model"]) + [[summary["steps"], loop, out / "adapter"]],
            "total_s": float((out / "total_s").read_text()),
            "own_eval_end": summary["eval_end"], "curve": _ours_curve(out),
            "bytes_per_step": summary["refit_bytes_per_step"], "trainable_params": params,
            "trainable_expert_params": expert,
            "time_split_s": {"rollout": summary["rollout_busy_frac"] * summary["wall_s"],
                             "train": summary["train_busy_frac"] * summary["wall_s"], "eval": summary["eval_s"]},
            "s_per_step": {k: summary.get(f"{k}_s_per_step") for k in ("rollout", "train", "push")},
            "settings": {"mode": summary["mode"], "steps": summary["steps"], "seed": seed,
                         "replay": summary["replay"], "rollout_dtype": rollout_dtype, "serving": summary["serving"],
                         "layout": summary["layout"], "rollout": "vLLM (CPU)", "task": task, **OURS_SETTINGS}}


def _ours_points(out: Path, model: str) -> list[list]:
    """[step, loop seconds, PEFT adapter] of each checkpoint before the last step (refit/export.checkpoint_to_peft)."""
    from ...checkpoint.directory import step_of
    from ...refit.export import checkpoint_to_peft

    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r}
    last = max(rows)
    points = []
    for d in sorted((out / "checkpoints").glob("step-*")):
        k = step_of(d.name)
        if k is None or k >= last or not (d / "manifest.json").exists():
            continue
        dest = out / "adapters" / f"step-{k}"
        if not (dest / "adapter_model.safetensors").exists():
            checkpoint_to_peft(d, model, dest)
        points.append([k, rows[k]["wall_s"] - rows[k]["eval_s"], dest])
    return points


def _ours_curve(out: Path) -> list[list[float]]:
    """[loop seconds, reward] per step: the run's seconds, evaluation left out."""
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [[r["wall_s"] - r["eval_s"], r["reward"]] for r in rows if r["step"] >= 1 and "reward" in r]


def run_trl(out: Path, model: str, steps: int, seed: int, lora_config: Path, reuse: bool, every: int,
            task: str = "sort") -> dict:
    from ...checks.torchrun import worker_env
    from .trl_env import PeerUnavailable, ensure

    if not reuse:
        try:
            py = ensure()
        except PeerUnavailable as e:
            raise PeerFailed(str(e)) from None
        t0 = time.perf_counter()
        p = subprocess.run([str(py), "-m", "moe_lora_rl.bench.runners.trl_grpo", "--model", model, "--lora-config",
                            str(lora_config), "--out", str(out), "--steps", str(steps), "--seed", str(seed),
                            "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP), "--save-every", str(every),
                            "--task", task],
                           capture_output=True, text=True, env=worker_env(), timeout=7200)
        if p.returncode != 0:
            why = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise PeerFailed(f"trl: its run failed (rc {p.returncode}): {why[:200]}")
        (out / "total_s").write_text(f"{time.perf_counter() - t0:.1f}\n")
    if not (out / "summary.json").exists():
        raise PeerFailed(f"trl: no finished run in {out}")
    s = json.loads((out / "summary.json").read_text())
    times = s["step_times"]
    points = [[k, sum(times[:k]), out / "trainer" / f"checkpoint-{k}"] for k in range(every, s["steps"], every)]
    return {"adapter": out / "adapter", "samples": s["samples"], "loop_s": s["wall_s"],
            "points": points + [[s["steps"], s["wall_s"], out / "adapter"]],
            "total_s": float((out / "total_s").read_text()), "bytes_per_step": 0,
            "versions": s["versions"], "settings": s["settings"],
            "curve": [[sum(s["step_times"][:i + 1]), r] for i, r in enumerate(s["reward_curve"])],
            "trainable_params": s["trainable_params"], "trainable_expert_params": s["trainable_expert_params"]}


def run_verl(out: Path, model: str | None, steps: int, rollout_dtype: str, reuse: bool, every: int) -> dict:
    from .verl_runs import run

    overrides = [f"actor_rollout_ref.rollout.dtype={rollout_dtype}", f"trainer.save_freq={every}",
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
            "points": _verl_points(out, model, r["curve"]),
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


def _verl_checkpoints(root: Path) -> dict[int, Path]:
    """{verl's global step: the step directory our engine saved there} (root/global_step_N/actor/step-N)."""
    found = {int(f.parts[-4].removeprefix("global_step_")): f.parent
             for f in root.glob("global_step_*/actor/step-*/manifest.json")}
    if not found:
        raise PeerFailed(f"verl: no checkpoint of our engine under {root} (trainer.save_freq)")
    return found


def _last_checkpoint(root: Path) -> Path:
    found = _verl_checkpoints(root)
    return found[max(found)]


def _as_peft(ckpt: Path, model: str | None, dest: Path) -> Path:
    """verl's adapters of one checkpoint as a PEFT adapter (refit/export.checkpoint_to_peft), for the one evaluator."""
    from ...refit.export import checkpoint_to_peft

    if not (dest / "adapter_model.safetensors").exists():
        from ...rl.config import TrainConfig
        from ...rl.inputs import model_dir

        checkpoint_to_peft(ckpt, model or model_dir(TrainConfig())[0], dest)
    return dest


def _verl_adapter(out: Path, model: str | None) -> Path:
    return _as_peft(_last_checkpoint(out / "ckpt"), model, out / "adapter")


def _verl_points(out: Path, model: str | None, curve) -> list[list]:
    """[step, loop seconds (verl's timing_s/step summed to that step), PEFT adapter] of each saved step."""
    found = _verl_checkpoints(out / "ckpt")
    last = max(found)
    return [[k, sum(c[1] for c in curve if c[0] <= k),
             out / "adapter" if k == last else _as_peft(found[k], model, out / "adapters" / f"step-{k}")]
            for k in sorted(found)]


def run_peers(names, runners: dict) -> tuple[dict, dict]:
    """Each named peer's result, and {peer: one line} for those that failed; a failure stops that peer alone."""
    from .peak_rss import PeakChildrenRss

    results, errors = {}, {}
    for name in names:
        try:
            with PeakChildrenRss() as peak:
                results[name] = runners[name]()
            results[name]["peak_rss_mb"] = peak.mb or None          # None: a reused run, not measured
        except PeerFailed as e:
            errors[name] = str(e)
    return results, errors
