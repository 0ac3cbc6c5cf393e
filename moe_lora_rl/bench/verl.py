"""verl: our engine and refit inside verl 0.9.1 (CPU, fp32).

    python -m moe_lora_rl.bench verl --json [--model DIR] [--layouts tp2ep2,pp2ep2] [--learn-steps 80]
        [--test-freq 10] [--png FILE] [--out DIR [--reuse]] [--no-runs]

config_ok: verl's own ppo_megatron_trainer config composed with our overrides passes our start-up checks and
resolves to our engine config. logprob_max_diff_vs_reference: worst max |log-prob diff| over layouts between our
engine driven through verl's TrainingWorker and a tp1ep1pp1 reference built without it (fp32_batch_shape_floor:
the reference against itself at another batch shape). loss_diff_vs_reference / gspo_loss_diff: |verl ppo_loss
(vanilla, token-mean / gspo, seq-mean-token-sum) through our engine - verl's loss on the reference|, worst layout.
refit_logprob_diff: max |vLLM log-prob - Megatron+LoRA log-prob| after our weight stream went through our
checkpoint-engine backend into an in-process vLLM engine; colocated_refit_logprob_diff: the same after verl's
colocated sync (its BucketedWeightSender -> our update_weights_from_ipc, base then adapters) into that engine started
on dummy weights. One torchrun launch of 4 ranks for all layouts.

verl's main_ppo runs (bench/runners/verl_runs.py; the warm-started default model unless --model; skipped with --no-runs):
main_ppo_r3_kl / main_ppo_r3_off_kl / main_ppo_r3_shifted_kl: mean k3 KL of the trainer's log-prob recompute against
the fp32 rollout, with the rollout's routes replayed / with the trainer's own routing / with the rollout's routes one
token off (the control), over the recomputes of a 3-step run with R3 on.
async_trainer_versions_synced: the fraction of weight syncs after which the server served the version (and checksum)
the trainer sent, the worse of verl's one-step-off and fully-async trainers (--async-steps steps each,
run_cpu_async.sh);
async_trainer_probe_max_diff: the served log-probs of a fixed probe against our Megatron engine's on the same version,
recomputed from that version's checkpoint (checks/verl_async.py); ..._vs_other_version: against the neighbouring
version's (the control).
learn_eval_start / learn_eval_end / learn_eval_end_lr0: verl's greedy held-out success before training and after
--learn-steps steps of the learning run and of its lr=0 control (learn_curve / learn_curve_lr0: every validation).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from ..checks.layouts import check_layouts
from .emit import emit
from .runners.verl_runs import main_ppo_runs

WORLD = 4
CHECK_WORKER = "moe_lora_rl.checks.verl_worker"
REFIT_WORKER = "moe_lora_rl.checks.verl_refit"


def main(argv=None) -> dict:
    from ..models import get_model
    from ..checks.torchrun import run_process, run_torchrun

    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench verl")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the tiny glm4_moe model)")
    ap.add_argument("--layouts", default="tp2ep2,pp2ep2")
    ap.add_argument("--learn-steps", type=int, default=80, help="steps of the learning run and its lr=0 control")
    ap.add_argument("--test-freq", type=int, default=10, help="verl's validation every N steps (and before training)")
    ap.add_argument("--async-steps", type=int, default=4, help="steps of each async trainer run")
    ap.add_argument("--out", default=None, help="directory of the main_ppo runs (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="read the finished runs in --out instead of running them")
    ap.add_argument("--png", default=None, help="plot the learning curves (and our main job's, if given) here")
    ap.add_argument("--main-job", default=None, help="our main job's out_dir (metrics.jsonl) for the plot")
    ap.add_argument("--no-runs", action="store_true", help="only the in-process checks, no main_ppo runs")
    a = ap.parse_args(argv)
    if a.learn_steps < 1 or a.test_freq < 1 or a.async_steps < 1:
        raise ValueError(f"--learn-steps {a.learn_steps} / --test-freq {a.test_freq} / --async-steps {a.async_steps}: "
                         "each must be >= 1")
    if a.reuse and not a.out:
        raise ValueError("--reuse reads the runs of --out: give --out DIR")
    if a.no_runs and (a.reuse or a.out or a.png or a.main_job):
        raise ValueError("--no-runs runs no main_ppo: --out, --reuse, --png and --main-job need the runs")
    if a.main_job and not Path(a.main_job, "metrics.jsonl").is_file():
        raise ValueError(f"--main-job {a.main_job!r}: no metrics.jsonl there")
    model = a.model or str(get_model("glm4_moe", "tiny"))
    layouts = check_layouts([model], a.layouts)
    for name, lay in zip([n.strip() for n in a.layouts.split(",") if n.strip()], layouts):
        if WORLD % lay.min_world_size or 8 % (WORLD // (lay.tp * lay.pp)):
            raise ValueError(f"--layouts {name!r}: runs on {lay.min_world_size} ranks; this bench launches "
                             f"{WORLD} (a layout needs a world size dividing {WORLD})")
    cfg_ok = _config_ok(model)
    eng = run_torchrun(CHECK_WORKER, WORLD, ["--model", model, "--layouts", a.layouts])
    refit = run_process(REFIT_WORKER, ["--model", model], what="refit worker")
    per = eng["layouts"]
    res = {"config_ok": cfg_ok,
           "logprob_max_diff_vs_reference": max(r["logprob_max_diff"] for r in per.values()),
           "loss_diff_vs_reference": max(r["loss_vanilla_diff"] for r in per.values()),
           "gspo_loss_diff": max(r["loss_gspo_diff"] for r in per.values()),
           "refit_logprob_diff": refit["refit_logprob_diff"],
           "colocated_refit_logprob_diff": refit["colocated_logprob_diff"],
           "layouts": list(per),
           "fp32_batch_shape_floor": eng["fp32_batch_shape_floor"],
           "per_layout": per,
           "refit": {k: refit[k] for k in ("base_vs_lora", "dummy_vs_megatron_base", "buckets",
                                                     "first_names", "second_names")}}
    if not a.no_runs:
        res.update(main_ppo_runs(a))
        if a.png:
            from .runners.figures import verl_learning_png

            verl_learning_png(a.png, res["learn_curve"], res["learn_curve_lr0"], a.main_job)
            res["png"] = a.png
    emit(res, a.json)
    return res


def _config_ok(model: str) -> bool:
    code = ("from moe_lora_rl.checks.verl_compose import compose, our_overrides\n"
            "from moe_lora_rl.integration.verl.verl_config import check_config, MoELoRAEngineConfig\n"
            "from verl.utils.config import omega_conf_to_dataclass\n"
            f"cfg = compose(our_overrides({model!r}, tp=2, ep=2, device='cpu', dtype='float32'))\n"
            "check_config(cfg)\n"
            "assert isinstance(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).engine, MoELoRAEngineConfig)\n"
            "print('CONFIG_OK')\n")
    from ..checks.torchrun import worker_env

    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=600)
    return proc.returncode == 0 and "CONFIG_OK" in proc.stdout
