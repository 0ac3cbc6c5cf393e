"""e2e: the main job (GRPO with expert LoRA, R3, LoRA-only refit) and, in the same run, the same job with lr=0 as
a control; each under torchrun on this machine.

    python -m moe_lora_rl.bench e2e --json [--model DIR] [--layouts tp1ep1pp1] [--nproc 2] [--steps N] [--data NAME]
        [--png FILE] [-- k=v ...]

--model: an HF checkpoint to train instead of the built-in warm-started model (model.path=DIR, no warm start).
--data NAME: train on a dataset of `python -m moe_lora_rl.data` (e.g. gsm8k_arith, scored by verl's gsm8k scorer),
written under the output folder, with its reference column for the warm start and its job settings
(moe_lora_rl.data.JOB_OVERRIDES); the free-routing targets below are the default task's.
--png FILE: the training reward and held-out success of both runs, drawn from their metrics.jsonl.
--layouts: the one layout both runs use. Anything after `--` is passed to both runs as hydra overrides.
Targets on 2 cores: wall_s <= 600 (warmup_s <= 300, reported separately), eval_start in [0.10, 0.40],
eval_end - eval_start >= 0.15, |eval_end_lr0 - eval_start| <= 0.03, kl_mean_r3 <= kl_mean_no_r3 / 3, ratio_gt2 <=
ratio_gt2_no_r3 / 3; on the default model free_disagreement_mean >= 0.03 and free_token_disagreement_mean >= 0.30
(the trainer routing freely vs the bf16 rollout's routes: decisions, tokens with one in >= 1 MoE layer).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .emit import emit
from .runners.jobs import check_job, data_overrides, job_layout, job_parser, run_job, split_overrides

KEYS = ("wall_s", "warmup_s", "warmup_cached", "reward_start", "reward_end", "eval_start", "eval_end", "kl_mean_r3",
        "kl_mean_no_r3", "ratio_gt2", "ratio_gt5", "ratio_gt2_no_r3", "ratio_gt5_no_r3", "disagreement_mean",
        "token_disagreement_mean", "free_disagreement_mean", "free_token_disagreement_mean", "refit_bytes_per_step",
        "full_bytes", "rollout_busy_frac", "train_busy_frac", "steps")


def main(argv=None, *, name: str = "e2e", doc: str = __doc__, recipe: list[str] = (), keys=KEYS) -> dict:
    """The job (recipe: e.g. ["--config-name=long"]) and its lr=0 control; `keys` of the job's summary, with the
    control's eval_end and eval_start."""
    argv, extra = split_overrides(argv)
    ap = job_parser(name, doc, "both runs")
    ap.add_argument("--nproc", type=int, default=2, help="torchrun processes per run")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the recipe's)")
    ap.add_argument("--data", default=None, help="a dataset of python -m moe_lora_rl.data (default: data.task's)")
    ap.add_argument("--png", default=None, help="draw both runs' reward and held-out success here")
    a = ap.parse_args(argv)
    lay, layout_over, model_over = job_layout(a, name)
    if a.nproc < 1 or a.timeout <= 0 or (a.steps is not None and a.steps < 1):
        raise ValueError(f"--nproc={a.nproc}, --steps={a.steps}, --timeout={a.timeout}: must be positive")
    overrides = [*recipe, *layout_over, *extra, *model_over]
    if a.steps:
        overrides.append(f"steps={a.steps}")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        if a.data is not None:
            overrides = [*data_overrides(a.data, root / "data"), *overrides]
        check_job(overrides, a.nproc)
        main_run = run_job(a.nproc, overrides, root / "main", a.timeout)
        control = run_job(a.nproc, [*overrides, "algo.lr=0"], root / "lr0", a.timeout)
        if a.png:
            from .runners.figures import e2e_png

            e2e_png(a.png, {"the job": root / "main", "lr=0 control": root / "lr0"},
                    f"bench e2e{' --data ' + a.data if a.data else ''}: {lay.name}, {main_run['steps']} steps")
    out = {k: main_run[k] for k in keys}
    out["eval_end_lr0"] = control["eval_end"]
    out["eval_start_lr0"] = control["eval_start"]
    out["layout"], out["bench_wall_s"] = lay.name, round(time.time() - t0, 1)
    if a.data is not None:
        out["data"] = a.data
    emit(out, a.json)
    return out


