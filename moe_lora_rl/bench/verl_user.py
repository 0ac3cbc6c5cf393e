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
checkpoint backend) for 2 steps, with verl's bypass mode off (the actor recomputes the old log-probs, so the in-run
R3 check has a recompute to compare): versions served, R3 k3.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .emit import emit
from .runners.verl_user_runs import default_model, learn, one_step_off, resume


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
    model = a.model or default_model()
    from ..checks.layouts import check_layouts

    layouts = check_layouts([model], ",".join([a.learn_layout, a.layouts]))
    learn_layout, others = layouts[0], layouts[1:]
    if not others:
        raise ValueError(f"--layouts {a.layouts!r}: give at least one layout to resume at")
    import tempfile

    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench_verl_user_"))
    res = {"model": model, "learn_layout": learn_layout.name}
    if not a.no_learn:
        res.update(learn(a, out, model, learn_layout))
    res.update(resume(a, out, model, learn_layout, others))
    res.update(one_step_off(a, out, model, learn_layout))
    if a.png and not a.no_learn:
        from .runners.figures import verl_learning_png

        verl_learning_png(a.png, res["learn_curve"], res["learn_curve_lr0"], None,
                          title=f"verl's Qwen3-MoE LoRA script, {learn_layout.name}")
        res["png"] = a.png
    res["runs_dir"] = str(out)
    emit(res, a.json)
    return res


