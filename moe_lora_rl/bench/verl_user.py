"""verl_user: a verl user's own Megatron + LoRA script through our override, at sharded layouts (CPU).

    python -m moe_lora_rl.bench verl_user --json [--model DIR] [--layouts tp1ep2,pp2,etp2] [--learn-layout tp2ep2]
        [--steps 40] [--test-freq 10] [--lr 1e-3] [--out DIR [--reuse]] [--png FILE] [--no-learn]

The script is recipes/verl_moe_lora/run_qwen3moe_megatron_lora_cpu.sh: verl 0.9.1's
examples/grpo_trainer/run_qwen3moe-30b_megatron_lora.sh kept key for key (rank 16 / alpha 32, the low-var KL loss,
dynamic batch sizes, full recompute, R3), scaled to CPU. Default model: the warm-started qwen3_moe wide (the sort
task's warm start), a Qwen3-30B-A3B-shaped model at CPU size.

learn_*: the script at --learn-layout learning the sort task for --steps steps (batch 16 prompts x the script's n 4,
responses 8 tokens, --lr: the script's 3e-6 is the 30B model's full-scale value and moves a rank-16 adapter on this
model nothing in 40 steps), validated by verl before training and every --test-freq steps (greedy, 256 held-out
problems), and its lr=0 control: learn_eval_start / learn_eval_end / learn_eval_end_lr0, the curves, the wall.
learn_r3_k3_max: the worst dp rank's mean k3 (trainer recompute with the rollout's routes vs the fp32 rollout) of
the learning run; learn_r3_shifted_k3_min: the same with the routes one token off (the control).
resume_* / layouts: the script at --learn-layout for 3 steps, saving at step 2, each weight sync recorded (version
and checksum of what the rollout serves); then at each of --layouts, resumed from that step-2 checkpoint for step 3:
resume_checksum_equal (the version each resumed run's rollout serves first is byte for byte the version the saving
run served after step 2), and per layout: finished, dp ranks, R3's worst k3 and the shifted control's least.
one_step_off_*: the script with TRAINER=one_step_off at --learn-layout (the rollout on its own worker fed by our
checkpoint backend) for 2 steps: versions served, R3 k3.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from .common import emit

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "verl_moe_lora" / "run_qwen3moe_megatron_lora_cpu.sh"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench verl_user")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the warm-started qwen3_moe wide)")
    ap.add_argument("--layouts", default="tp1ep2,pp2,etp2", help="layouts resumed from the saving run's checkpoint")
    ap.add_argument("--learn-layout", default="tp2ep2", help="layout of the learning, saving and one-step-off runs")
    ap.add_argument("--steps", type=int, default=40, help="steps of the learning run and its lr=0 control")
    ap.add_argument("--test-freq", type=int, default=10, help="verl's validation every N steps (and before training)")
    ap.add_argument("--lr", type=float, default=1e-3, help="the learning run's lr (its control: 0)")
    ap.add_argument("--out", default=None, help="directory of the runs (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="read the runs finished in --out, run the others")
    ap.add_argument("--png", default=None, help="plot the learning curves here")
    ap.add_argument("--no-learn", action="store_true", help="leave out the learning run and its control")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.test_freq < 1 or a.steps % a.test_freq:
        raise ValueError(f"--steps {a.steps} / --test-freq {a.test_freq}: both >= 1, steps a multiple of test-freq")
    if a.lr <= 0:
        raise ValueError(f"--lr {a.lr}: must be > 0 (the control runs at 0)")
    if a.reuse and not a.out:
        raise ValueError("--reuse reads the runs of --out: give --out DIR")
    if a.no_learn and a.png:
        raise ValueError("--png plots the learning run: leave out --no-learn")
    model = a.model or _default_model()
    from ..checks.layouts import check_layouts

    layouts = check_layouts([model], ",".join([a.learn_layout, a.layouts]))
    learn_layout, others = layouts[0], layouts[1:]
    if not others:
        raise ValueError(f"--layouts {a.layouts!r}: give at least one layout to resume at")
    import tempfile

    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench_verl_user_"))
    res = {"model": model, "learn_layout": learn_layout.name}
    if not a.no_learn:
        res.update(_learn(a, out, model, learn_layout))
    res.update(_resume(a, out, model, learn_layout, others))
    res.update(_one_step_off(a, out, model, learn_layout))
    if a.png and not a.no_learn:
        from .figures import verl_learning_png

        verl_learning_png(a.png, res["learn_curve"], res["learn_curve_lr0"], None,
                          title=f"verl's Qwen3-MoE LoRA script, {learn_layout.name}")
        res["png"] = a.png
    res["runs_dir"] = str(out)
    emit(res, a.json)
    return res


def _default_model() -> str:
    from ..rl.config import TrainConfig
    from ..rl.config.model_settings import ModelSettings
    from ..rl.inputs import model_dir

    return str(model_dir(TrainConfig(model=ModelSettings(family="qwen3_moe", size="wide")))[0])


def _env(layout, model: str, steps: int, **extra) -> dict:
    return {"TP": str(layout.tp), "EP": str(layout.ep), "ETP": str(layout.etp), "PP": str(layout.pp),
            "MODEL": model, "STEPS": str(steps), "RESPONSE_LEN": "8", "TIMEOUT": "5400", **extra}


def _run(out: Path, env: dict, overrides: list[str], reuse: bool, steps: int) -> dict:
    from .runners.verl_runs import parse_steps, parse_val, run_script

    if not (reuse and (out / "wall_s").is_file()):
        shutil.rmtree(out / "ckpt", ignore_errors=True)         # what an earlier, unfinished attempt left
        (out / "sync.jsonl").unlink(missing_ok=True)
        run_script(SCRIPT, out, overrides, env)
    text = (out / "run.log").read_text()
    done = parse_steps(text)
    if done < steps:
        raise RuntimeError(f"{out / 'run.log'}: {done} training steps logged, {steps} expected")
    return {"val": parse_val(text), "steps": done, "wall_s": float((out / "wall_s").read_text())}


def _r3(out: Path) -> dict:
    """Per dp rank: the worst mean k3 with replay and the least with shifted routes (r3_check.jsonl)."""
    from .runners.verl_runs import parse_r3_by_rank

    per = parse_r3_by_rank(out / "r3_check.jsonl")
    return {"dp_ranks": sorted(per), "k3_max": max(r["k3_replay"] for r in per.values()),
            "shifted_k3_min": min(r["k3_shifted"] for r in per.values()),
            "k3_free_max": max(r["k3_free"] for r in per.values())}


LEARN = ["trainer.val_before_train=True", "data.train_max_samples=-1", "data.val_max_samples=-1",
         "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]


def _learn(a, out: Path, model: str, layout) -> dict:
    env = _env(layout, model, a.steps)
    runs = {}
    for name, lr in (("learn", a.lr), ("learn_lr0", 0.0)):
        runs[name] = _run(out / name, env, [*LEARN, f"trainer.test_freq={a.test_freq}",
                                           f"actor_rollout_ref.actor.optim.lr={lr}"], a.reuse, a.steps)
        if 0 not in runs[name]["val"] or a.steps not in runs[name]["val"]:
            raise RuntimeError(f"{out / name}: validations at steps {sorted(runs[name]['val'])}, need 0 and {a.steps}")
    learn, lr0 = runs["learn"], runs["learn_lr0"]
    r3 = _r3(out / "learn")
    return {"learn_eval_start": learn["val"][0], "learn_eval_end": learn["val"][a.steps],
            "learn_eval_start_lr0": lr0["val"][0], "learn_eval_end_lr0": lr0["val"][a.steps],
            "learn_gain_over_lr0": learn["val"][a.steps] - lr0["val"][a.steps],
            "learn_curve": learn["val"], "learn_curve_lr0": lr0["val"], "learn_steps": a.steps, "learn_lr": a.lr,
            "learn_wall_s": learn["wall_s"], "learn_r3_k3_max": r3["k3_max"],
            "learn_r3_shifted_k3_min": r3["shifted_k3_min"], "learn_r3_free_k3_max": r3["k3_free_max"]}


def _served(path: Path) -> list[dict]:
    lines = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []
    return [l for l in lines if l.get("side") == "server"]


def _resume(a, out: Path, model: str, layout, others) -> dict:
    save = out / "save"
    sync = [f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.moe_lora.sync_log={save}/sync.jsonl"]
    _run(save, _env(layout, model, 3), ["trainer.save_freq=2", *sync], a.reuse, 3)
    saved = {l["version"]: l["checksum"] for l in _served(save / "sync.jsonl")}
    ckpt = save / "ckpt" / "global_step_2"
    if not ckpt.is_dir() or 2 not in saved:
        raise RuntimeError(f"{save}: no step-2 checkpoint ({ckpt}) or no served version 2 in sync.jsonl: {saved}")
    per, equal = {}, True
    for lay in others:
        d = out / f"resume_{lay.name}"
        log = f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.moe_lora.sync_log={d}/sync.jsonl"
        _run(d, _env(lay, model, 3), ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}", log],
             a.reuse, 1)
        # verl syncs once before it loads the checkpoint (version 0, the fresh adapters): the version it serves after
        first = next((l for l in _served(d / "sync.jsonl") if l["version"] != 0), None)
        if first is None:
            raise RuntimeError(f"{d}: the resumed run served no version other than 0 (was the checkpoint loaded?)")
        same = first["version"] == 2 and first["checksum"] == saved[2]
        equal &= same
        per[lay.name] = {"first_served_version": first["version"], "checksum_equal": same, **_r3(d)}
    return {"resume_checksum_equal": equal, "resume_saved_at": layout.name,
            "resume_checksum_vs_version_1_differs": saved.get(1) not in (None, saved[2]),
            "layouts": per, "layouts_r3_k3_max": max(p["k3_max"] for p in per.values()),
            "layouts_r3_shifted_k3_min": min(p["shifted_k3_min"] for p in per.values())}


def _one_step_off(a, out: Path, model: str, layout) -> dict:
    d = out / "one_step_off"
    log = f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.moe_lora.sync_log={d}/sync.jsonl"
    r = _run(d, _env(layout, model, 2, TRAINER="one_step_off"), [log], a.reuse, 2)
    served = _served(d / "sync.jsonl")
    return {"one_step_off_versions_served": sorted({l["version"] for l in served}),
            "one_step_off_wall_s": r["wall_s"], **{f"one_step_off_r3_{k}": v for k, v in _r3(d).items()}}
