"""recipes/verl_moe_lora/ray_on_slurm.sbatch on the local slurm (scripts/slurm/local_cluster.sh, CPU-only nodes):
Ray started as a slurm step of the job, then verl's CPU smoke recipe (run_cpu_smoke.sh: main_ppo with our engine,
replica and CPU platform on the tiny model, 2 GRPO steps, R3 on) through it, joined over RAY_ADDRESS.

One Ray node (RAY_NODES=1): both slurm nodes of the local cluster are this one host, and a second `ray start
--address` there shares the head's address (Ray keys a node by its IP), so the join is refused; the smoke asks for
one Ray "GPU" (our CPU platform's), which the head declares (RAY_GPUS=1). Slow (verl's startup dominates; see
docs/cluster.md for the time it took): `bash scripts/test.sh --all` runs it."""
import json
import os
import socket
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.verl, pytest.mark.slow]

from kit.slurm_cluster import PYTHON, RAY_SBATCH, ROOT, LocalCluster, SlurmUnavailable  # noqa: E402
from kit.slurm_cluster import leftovers  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_smoke_through_ray_on_slurm(tmp_path):
    port = free_port()
    env = {"RUN_SCRIPT": str(ROOT / "recipes" / "verl_moe_lora" / "run_cpu_smoke.sh"), "RAY_GPUS": "1",
           "RAY_CPUS": "4", "RAY_NODES": "1", "RAY_PORT": str(port),
           "PATH": f"{Path(PYTHON).parent}:{os.environ['PATH']}", "PYTHON": PYTHON}
    cluster = LocalCluster(tmp_path / "slurm", gpus=0)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    try:
        out = tmp_path / "job"
        p = cluster.submit(out, ["--nodes=1", "--gpus-per-node=0"], RAY_SBATCH, [str(out / "smoke")], env=env)
        console = cluster.finish(p, out, timeout=1800)
    finally:
        cluster.stop()
    assert "ray_on_slurm.sbatch: 1 Ray nodes up in" in console, console[-3000:]
    assert "SMOKE: finished, 2 step lines logged" in console, console[-3000:]
    log = (out / "smoke" / "run.log").read_text()
    assert f":{port}" in log or "Connecting to existing Ray cluster" in log, log[:3000]   # joined, not a local Ray
    checks = [json.loads(line) for line in (out / "smoke" / "r3_check.jsonl").read_text().splitlines()]
    assert len(checks) >= 2, "no R3 check records"
    # the workers run our CPU platform and replica through the joined cluster: the same R3 figures as the local-Ray
    # smoke (test_verl_main_ppo_cpu), with its control (routes shifted one token)
    assert max(c["k3_replay"] for c in checks) < 1e-8 and max(c["max_abs_diff_replay"] for c in checks) < 1e-3, checks
    assert min(c["k3_shifted"] for c in checks) > 1e-5, checks
    assert not leftovers(f"{port}") and not leftovers(str(out)), (leftovers(f"{port}"), leftovers(str(out)))
