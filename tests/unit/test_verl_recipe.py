"""recipes/verl_moe_lora: the run scripts' layouts against the models' real configs, the Ray-on-slurm batch script
with stub commands on PATH (scontrol, srun, ray, python), and the recipe config composed through its
hydra.searchpath onto verl's own config."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "verl_moe_lora"


def _check(*args):
    return subprocess.run([sys.executable, str(RECIPE / "check_layouts.py"), *args], capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": str(RECIPE.parents[1])})


@pytest.mark.parametrize("script, model", [("run_qwen3_30b_a3b.sh", "qwen3-30b-a3b"), ("run_kimi_k2.sh", "kimi-k2")])
def test_run_script_layouts_fit_the_real_models(script, model):
    text = (RECIPE / script).read_text()
    env = dict(l.split("=", 1) for l in " ".join(
        part for line in text.splitlines() if line.startswith("TP=") for part in line.split(";")).split())
    val = {k.strip(): v.strip().strip("${}").split(":-")[-1] for k, v in env.items()}
    layout = f"tp{val['TP']}ep{val['EP']}pp{val['PP']}"
    r = _check(model, layout, val["TRAIN_GPUS"])
    assert r.returncode == 0, r.stderr
    bad = _check(model, f"tp{val['TP']}ep{int(val['EP']) * 3}pp{val['PP']}", val["TRAIN_GPUS"])   # control
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "check_layouts: error:" in bad.stderr


def test_ray_on_slurm_with_stub_commands(tmp_path):
    log = tmp_path / "calls.log"
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in {
        "scontrol": 'echo "$*" >> "$LOG"; printf "node-a\\nnode-b\\nnode-c\\n"',
        "srun": 'echo "srun $*" >> "$LOG"; while [ "${1#-}" != "$1" ]; do [ "$1" = -w ] && shift; shift; done; '
                '"$@"',
        "hostname": 'echo 10.0.0.1',
        # `ray status`: one active node per `ray start` so far (the script waits for all of them)
        # `ray get-auth-token --generate`: the token (the script passes it to every step)
        "ray": 'echo "ray $* auth=$RAY_AUTH_MODE:$RAY_AUTH_TOKEN" >> "$LOG"; case "$1" in get-auth-token) echo tok-1;; esac; '
               '[ "$1" = status ] && grep "^ray start" "$LOG" | sed "s/.*/ 1 node_x/"',
        "bash": 'echo "run $* NNODES=$NNODES RAY_ADDRESS=$RAY_ADDRESS auth=$RAY_AUTH_MODE:$RAY_AUTH_TOKEN" >> "$LOG"',
    }.items():
        p = stubs / name
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "LOG": str(log), "SLURM_JOB_NODELIST": "node-[a-c]",
           "SLURM_GPUS_PER_NODE": "8",
           "RUN_SCRIPT": "recipes/verl_moe_lora/run_qwen3_30b_a3b.sh"}
    r = subprocess.run(["/bin/bash", str(RECIPE / "ray_on_slurm.sbatch"), "trainer.total_epochs=1"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    heads = [c for c in calls if c.startswith("ray start --head")]
    workers = [c for c in calls if c.startswith("ray start --address=10.0.0.1:6379")]
    runs = [c for c in calls if c.startswith("run ")]
    assert len(heads) == 1 and "--node-ip-address=10.0.0.1" in heads[0] and "--num-gpus=8" in heads[0]
    assert len(workers) == 2
    assert any("-w node-a" in c and "ray start --head" in c for c in calls)
    assert {c.split("-w ")[1].split()[0] for c in calls if "--address=" in c and c.startswith("srun")} == \
        {"node-b", "node-c"}
    assert runs == ["run recipes/verl_moe_lora/run_qwen3_30b_a3b.sh trainer.total_epochs=1 NNODES=3 "
                    "RAY_ADDRESS=10.0.0.1:6379 auth=token:tok-1"]
    # one token mode and token for the head, the joins and the status polls (else `ray status` never sees the head)
    rays = [c for c in calls if c.startswith("ray ") and not c.startswith("ray get-auth-token")]
    assert rays and all(c.endswith(" auth=token:tok-1") for c in rays), rays
    assert calls.index(heads[0]) < calls.index(workers[0]) < calls.index(runs[0])


@pytest.mark.verl
def test_recipe_config_composes_onto_verls_and_passes_our_checks():
    from hydra import compose, initialize_config_dir

    from moe_lora_rl.integration.verl.verl_config import MoELoRAEngineConfig, check_config
    from moe_lora_rl.models import get_model
    from verl.utils.config import omega_conf_to_dataclass

    with initialize_config_dir(config_dir=str(RECIPE / "config"), version_base=None):
        cfg = compose("verl_moe_lora", overrides=[f"actor_rollout_ref.model.path={get_model('glm4_moe', 'tiny')}",
                                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    check_config(cfg)
    assert cfg.trainer.n_gpus_per_node is not None and cfg.algorithm.adv_estimator    # verl's own keys are there
    eng = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).engine
    assert isinstance(eng, MoELoRAEngineConfig) and eng.router_replay.mode == "R3"
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "moe_lora"
