"""verl: our engine and refit inside verl 0.9.1 (CPU, fp32).

    python -m moe_lora_rl.bench verl --json [--model DIR] [--layouts tp2ep2,pp2ep2]

config_ok: verl's own ppo_megatron_trainer config composed with our overrides passes our start-up checks and
resolves to our engine config. logprob_max_diff_vs_reference: worst max |log-prob diff| over layouts between our
engine driven through verl's TrainingWorker and a tp1ep1pp1 reference built without it (fp32_batch_shape_floor:
the reference against itself at another batch shape). loss_diff_vs_reference / gspo_loss_diff: |verl ppo_loss
(vanilla, token-mean / gspo, seq-mean-token-sum) through our engine - verl's loss on the reference|, worst layout.
refit_logprob_diff: max |vLLM log-prob - Megatron+LoRA log-prob| after our weight stream went through our
checkpoint-engine backend into an in-process vLLM engine; colocated_refit_logprob_diff: the same after verl's
colocated sync (its BucketedWeightSender -> our update_weights_from_ipc, base then adapters) into that engine started
on dummy weights. One torchrun launch of 4 ranks for all layouts.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from ..checks.layouts import check_layouts
from .common import emit

WORLD = 4
CHECK_WORKER = "moe_lora_rl.checks.verl_worker"
REFIT_WORKER = "moe_lora_rl.checks.verl_refit"


def main(argv=None) -> dict:
    from ..models import get_model
    from ..checks.launch import run_process, run_torchrun

    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench verl")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the tiny glm4_moe model)")
    ap.add_argument("--layouts", default="tp2ep2,pp2ep2")
    a = ap.parse_args(argv)
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
    emit(res, a.json)
    return res


def _config_ok(model: str) -> bool:
    code = ("from moe_lora_rl.checks.verl_compose import compose, our_overrides\n"
            "from moe_lora_rl.integration.verl.config import check_config, MoELoRAEngineConfig\n"
            "from verl.utils.config import omega_conf_to_dataclass\n"
            f"cfg = compose(our_overrides({model!r}, tp=2, ep=2, device='cpu', dtype='float32'))\n"
            "check_config(cfg)\n"
            "assert isinstance(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).engine, MoELoRAEngineConfig)\n"
            "print('CONFIG_OK')\n")
    from ..checks.launch import worker_env

    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=600)
    return proc.returncode == 0 and "CONFIG_OK" in proc.stdout
