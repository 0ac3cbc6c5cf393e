"""verl's own main_ppo through our recipe, as bench runs (recipes/verl_moe_lora/run_cpu_learn.sh), and what is read
from them: verl's validation curve (the `val-core/.../acc/mean@1` line of each validated step) and our in-run R3
check (`r3_check.jsonl`: k3 of the trainer's recompute against the rollout, with and without replay).

    r3      a few steps with fp32 rollouts, no validation: main_ppo_r3_kl (mean k3 with R3), main_ppo_r3_off_kl
            (the same recomputes without replay)
    learn   the learning run (lr 1e-3) and its lr=0 control, validated before training and every test_freq steps
    one_step_off   verl's one-step-off-policy trainer (run_cpu_async.sh one_step_off), checked by checks/verl_async.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LEARN = ROOT / "recipes" / "verl_moe_lora" / "run_cpu_learn.sh"
ASYNC = ROOT / "recipes" / "verl_moe_lora" / "run_cpu_async.sh"
ASYNC_CHECK = "moe_lora_rl.checks.verl_async"
ASYNC_TRAINERS = ("one_step_off", "fully_async")
PROBE_RE = re.compile(r"^PROBE='\[([0-9,]+)\]'", re.M)
_STEP = re.compile(r"step:(\d+) - (.*)$")
_TIMING = re.compile(r"timing_s/([a-z_]+):(?:np\.float64\()?([0-9.eE+-]+)")
_STEP_TIME = re.compile(r"timing_s/step:(?:np\.float64\()?([0-9.eE+-]+)")
_SCORE = re.compile(r"critic/score/mean:(?:np\.float64\()?([0-9.eE+-]+)")
_VAL = re.compile(r"val-core/[^ :]+/acc/mean@1:(?:np\.float64\()?([0-9.eE+-]+)")


def parse_val(log: str) -> dict[int, float]:
    """{step: held-out success} from verl's console lines (step 0: the validation before training)."""
    out = {}
    for line in log.splitlines():
        m = _STEP.search(line)
        if m:
            v = _VAL.search(m.group(2))
            if v:
                out[int(m.group(1))] = float(v.group(1))
    return out


def parse_timing(log: str) -> dict[str, float]:
    """verl's per-step timings summed over the training steps logged: {"step": s, "gen": s, "update_actor": s, ...}
    (timing_s/<name> of each step's metrics line; validation-only lines carry none of them but testing)."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = _STEP.search(line)
        if m and "training/global_step" in m.group(2):
            for name, v in _TIMING.findall(m.group(2)):
                out[name] = out.get(name, 0.0) + float(v)
    return out


def parse_curve(log: str) -> list[tuple[int, float, float]]:
    """(step, timing_s/step, critic/score/mean) of each training step logged."""
    out = []
    for line in log.splitlines():
        m = _STEP.search(line)
        if m and "training/global_step" in m.group(2):
            t, r = _STEP_TIME.search(m.group(2)), _SCORE.search(m.group(2))
            if t and r:
                out.append((int(m.group(1)), float(t.group(1)), float(r.group(1))))
    return out


def parse_steps(log: str) -> int:
    """Training steps logged (a validation-only line, such as step 0's, trains nothing)."""
    found = (_STEP.search(line) for line in log.splitlines())
    return len({int(m.group(1)) for m in found if m and "training/global_step" in m.group(2)})


def _r3_lines(path: Path) -> list[dict]:
    lines = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
    if not lines:
        raise RuntimeError(f"{path}: no R3 check lines (was R3 on and the rollout's log-probs recorded?)")
    return lines


def parse_r3(path: Path) -> dict:
    """Mean k3 with and without replay over the recomputes in r3_check.jsonl, and their largest |log-prob diff|."""
    lines = _r3_lines(path)
    mean = lambda k: sum(l[k] for l in lines) / len(lines)          # noqa: E731
    return {"k3_replay": mean("k3_replay"), "k3_free": mean("k3_free"), "recomputes": len(lines),
            "k3_shifted": mean("k3_shifted") if all("k3_shifted" in l for l in lines) else None,
            "max_abs_diff_replay": max(l["max_abs_diff_replay"] for l in lines),
            "max_abs_diff_free": max(l["max_abs_diff_free"] for l in lines)}


def parse_r3_by_rank(path: Path) -> dict[int, dict]:
    """parse_r3's figures per data-parallel rank ({dp_rank: {...}}; every rank writes its own lines)."""
    lines = _r3_lines(path)
    out = {}
    for rank in sorted({l["dp_rank"] for l in lines}):
        mine = [l for l in lines if l["dp_rank"] == rank]
        mean = lambda k: sum(l[k] for l in mine) / len(mine)          # noqa: E731
        out[rank] = {"k3_replay": mean("k3_replay"), "k3_free": mean("k3_free"), "recomputes": len(mine),
                     "k3_shifted": mean("k3_shifted") if all("k3_shifted" in l for l in mine) else None}
    return out


RAY_START_TIMEOUT = "The current node timed out during startup"
RAY_START_TRIES = 3
"""Ray waits 30 s (hard-coded) for its raylet to register: on a loaded machine a run can die there, before anything
of ours starts; such a run is started again, at most RAY_START_TRIES times in all."""


def run_script(script: Path, out: Path, overrides: list[str], env: dict, script_args: tuple = ()) -> float:
    """Run a recipe script into OUT with ENV added (the wall written to OUT/wall_s); RuntimeError with the end of its
    output if it fails."""
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(RAY_START_TRIES):
        t0 = time.perf_counter()
        p = subprocess.run(["bash", str(script), *script_args, str(out), *overrides],
                           env={**os.environ, "PYTHON": sys.executable, **env}, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        log = out / "run.log"
        if p.returncode == 0 or not log.is_file() or RAY_START_TIMEOUT not in log.read_text():
            break
    if p.returncode != 0:
        raise RuntimeError(f"verl run in {out} failed (rc {p.returncode}): {p.stdout[-1500:]}")
    (out / "wall_s").write_text(f"{wall:.1f}\n")
    return wall


def probe_tokens() -> str:
    """The probe the async trainers' script gives the servers (comma separated)."""
    return PROBE_RE.search(ASYNC.read_text()).group(1)


def run(out: Path, overrides: list[str], *, steps: int, test_freq: int, model: str | None, reuse: bool,
        timeout_s: int = 5400, script: Path = LEARN, script_args: tuple = (), count_steps: bool = True) -> dict:
    """One verl run of SCRIPT into OUT (or, with reuse, the finished run found there): its log's curve and wall.
    count_steps: require STEPS training steps in the log (verl's fully-async trainer logs a step's metrics at the
    next step and not the last one: its runs are counted by the versions they sync instead)."""
    log = out / "run.log"
    if not reuse:
        env = {"STEPS": str(steps), "TEST_FREQ": str(test_freq), "TIMEOUT": str(timeout_s)}
        if model:
            env["MODEL"] = model
        run_script(script, out, overrides, env, script_args)
    if not log.exists():
        raise RuntimeError(f"{log} does not exist (run without --reuse first)")
    text = log.read_text()
    done = parse_steps(text)
    if count_steps and done < steps:
        raise RuntimeError(f"{log}: {done} training steps logged, {steps} expected")
    wall_f = out / "wall_s"
    return {"val": parse_val(text), "steps": done, "timing": parse_timing(text), "curve": parse_curve(text),
            "wall_s": float(wall_f.read_text()) if wall_f.exists() else None}


def main_ppo_runs(a) -> dict:
    """bench verl's runs of verl's own trainers (a: its arguments): main_ppo's R3 check, the learning run and its lr=0
    control, each async trainer checked by checks/verl_async.py; the figures read from them."""
    import tempfile

    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench_verl_"))
    kw = dict(model=a.model, reuse=a.reuse)
    r3 = run(out / "r3_fp32", ["actor_rollout_ref.rollout.dtype=float32", "trainer.val_before_train=false"],
             steps=3, test_freq=-1, **kw)
    kl = parse_r3(out / "r3_fp32" / "r3_check.jsonl")
    learn = run(out / "learn", [], steps=a.learn_steps, test_freq=a.test_freq, **kw)
    lr0 = run(out / "learn_lr0", ["actor_rollout_ref.actor.optim.lr=0"], steps=a.learn_steps, test_freq=a.test_freq,
              **kw)
    from ...checks.torchrun import run_process

    trainers = {}
    for name in ASYNC_TRAINERS:
        r = run(out / name, [], steps=a.async_steps, test_freq=-1, model=a.model, reuse=a.reuse, script=ASYNC,
                script_args=(name,), count_steps=False)
        check = run_process(ASYNC_CHECK, ["--run", str(out / name), "--model", str(out / name / "model"),
                                          "--probe", probe_tokens()], what="async check")
        # one-step-off syncs before each step's rollout (after N steps it has served 0..N-1), fully-async after each
        if max(check["versions_served"]) < a.async_steps - 1:
            raise RuntimeError(f"{out / name}: versions {check['versions_served']} served, {a.async_steps} steps asked")
        trainers[name] = {**check, "steps": a.async_steps, "wall_s": r["wall_s"]}
    for name, r in (("learn", learn), ("learn_lr0", lr0)):
        if 0 not in r["val"] or a.learn_steps not in r["val"]:
            raise RuntimeError(f"{out / name}: validations at steps {sorted(r['val'])}, need 0 and {a.learn_steps}")
    res = {"main_ppo_r3_kl": kl["k3_replay"], "main_ppo_r3_off_kl": kl["k3_free"],
           "main_ppo_r3_max_abs_diff": kl["max_abs_diff_replay"], "main_ppo_r3_shifted_kl": kl["k3_shifted"],
           "main_ppo_r3_off_max_abs_diff": kl["max_abs_diff_free"],
           "learn_eval_start": learn["val"][0], "learn_eval_end": learn["val"][a.learn_steps],
           "learn_eval_end_lr0": lr0["val"][a.learn_steps], "learn_eval_start_lr0": lr0["val"][0],
           "learn_curve": learn["val"], "learn_curve_lr0": lr0["val"], "learn_wall_s": learn["wall_s"],
           "learn_steps": a.learn_steps, "runs_dir": str(out),
           "async_trainer_versions_synced": min(t["versions_synced"] for t in trainers.values()),
           "async_trainer_probe_max_diff": max(t["probe_max_diff"] for t in trainers.values()),
           "async_trainer_probe_diff_vs_other_version": min(t["probe_diff_vs_other_version"]
                                                            for t in trainers.values()),
           "async_trainers": {n: {k: t[k] for k in ("syncs", "versions_synced", "versions_served", "probe_max_diff",
                                                     "probe_diff_vs_other_version", "steps", "wall_s")}
                              for n, t in trainers.items()}}
    return res
