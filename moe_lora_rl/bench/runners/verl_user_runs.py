"""The runs of bench verl_user: the verl user's Megatron + LoRA script
(recipes/verl_moe_lora/run_qwen3moe_megatron_lora_cpu.sh) at a layout, and what is read from them: the learning
run and its lr=0 control, the saving run and its resumes at other layouts (the first served version's checksum),
one-step-off; R3's k3 per dp rank.

    learn(a, out, model, layout); resume(a, out, model, layout, others); one_step_off(a, out, model, layout)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "recipes" / "verl_moe_lora" / "run_qwen3moe_megatron_lora_cpu.sh"


def default_model() -> str:
    from ...rl.config import TrainConfig
    from ...rl.config.model_settings import ModelSettings
    from ...rl.inputs import model_dir

    return str(model_dir(TrainConfig(model=ModelSettings(family="qwen3_moe", size="wide")))[0])


def _env(layout, model: str, steps: int, **extra) -> dict:
    return {"TP": str(layout.tp), "EP": str(layout.ep), "ETP": str(layout.etp), "PP": str(layout.pp),
            "MODEL": model, "STEPS": str(steps), "RESPONSE_LEN": "8", "TIMEOUT": "5400", **extra}


def _run(out: Path, env: dict, overrides: list[str], reuse: bool, steps: int) -> dict:
    from .verl_runs import parse_steps, parse_val, run_script

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
    from .verl_runs import parse_r3_by_rank

    per = parse_r3_by_rank(out / "r3_check.jsonl")
    return {"dp_ranks": sorted(per), "k3_max": max(r["k3_replay"] for r in per.values()),
            "shifted_k3_min": min(r["k3_shifted"] for r in per.values()),
            "k3_free_max": max(r["k3_free"] for r in per.values())}


LEARN = ["trainer.val_before_train=True", "data.train_max_samples=-1", "data.val_max_samples=-1",
         "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]


def learn(a, out: Path, model: str, layout) -> dict:
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


def resume(a, out: Path, model: str, layout, others) -> dict:
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


def one_step_off(a, out: Path, model: str, layout) -> dict:
    d = out / "one_step_off"
    log = f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.moe_lora.sync_log={d}/sync.jsonl"
    # verl's one-step-off config trains in bypass mode (the rollout's log-probs as the old policy's): no recompute,
    # so nothing for the in-run R3 check to compare; bypass off, the actor recomputes them with the routes replayed
    r = _run(d, _env(layout, model, 2, TRAINER="one_step_off"), [log, "algorithm.rollout_correction.bypass_mode=false"],
             a.reuse, 2)
    served = _served(d / "sync.jsonl")
    return {"one_step_off_versions_served": sorted({l["version"] for l in served}),
            "one_step_off_wall_s": r["wall_s"], **{f"one_step_off_r3_{k}": v for k, v in _r3(d).items()}}
