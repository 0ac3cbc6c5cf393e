"""The local two-node slurm of scripts/slurm/local_cluster.sh as the tests and benches use it: started in a folder
of their own, jobs submitted with `sbatch --wait` one at a time, their processes found on the one host, the cluster
stopped (its jobs cancelled, its daemons ended by pid) whatever happens.

    with LocalCluster(tmp / "slurm", gpus=2) as c:       # SlurmUnavailable (a reason to skip) if it cannot start
        p = c.submit(out, ["--nodes=2", "--gpus-per-node=2"], TRAIN_SBATCH, ["--rollout=node", "steps=4"])
        console = c.finish(p, out)                          # the job's output; AssertionError if it failed
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from moe_lora_rl.checks.torchrun import worker_env
from moe_lora_rl.checks.train_runs import failure_report

ROOT = Path(__file__).resolve().parents[2]
LOCAL_CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"
TRAIN_SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
RAY_SBATCH = ROOT / "recipes" / "verl_moe_lora" / "ray_on_slurm.sbatch"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "sinfo")


class SlurmUnavailable(RuntimeError):
    """slurm cannot start on this machine (not root, packages missing, daemons refused): the reason to skip."""


def unavailable() -> str | None:
    """Why local_cluster.sh cannot start here, or None."""
    if os.geteuid() != 0:
        return "the local slurm cluster needs root (slurmd; a line in /etc/hosts)"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"slurm not installed ({', '.join(missing)} missing): bash scripts/setup.sh --slurm"
    return None


def _ports_free(base: int) -> bool:
    import socket

    for port in range(base, base + 3):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return False
    return True


class LocalCluster:
    """Two slurmd (this host's name and NAME-n2) with `gpus` placeholder GPUs each (0: CPU-only nodes)."""

    def __init__(self, root: Path, gpus: int = 0):
        self.root, self.gpus = Path(root), gpus
        self.started = False
        self.pids: list[int] = []            # the daemons it started (local_cluster.sh's DIR/pids)

    @property
    def env(self) -> dict:
        return {**worker_env(), "SLURM_CONF": str(self.root / "slurm.conf")}

    @property
    def nodes(self) -> tuple[str, str]:
        import socket

        host = socket.gethostname()
        return host, f"{host}-n2"

    def start(self) -> "LocalCluster":
        reason = unavailable()
        if reason:
            raise SlurmUnavailable(reason)
        base = next((b for b in range(16817, 30000, 101) if _ports_free(b)), None)
        if base is None:
            raise SlurmUnavailable("no three free ports from 16817 on")
        proc = subprocess.run(["bash", str(LOCAL_CLUSTER), "start", f"--gpus={self.gpus}", f"--dir={self.root}",
                               f"--port={base}"], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"local_cluster.sh start failed: {(proc.stdout + proc.stderr).strip()[-1500:]}")
        self.started = True
        self.pids = [int(line.split()[1]) for line in (self.root / "pids").read_text().splitlines()]
        return self

    def stop(self) -> None:
        if self.started:
            subprocess.run(["bash", str(LOCAL_CLUSTER), "stop", f"--dir={self.root}"], capture_output=True,
                           text=True, timeout=120)
            self.started = False

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, out: Path, sbatch_args, script: Path, script_args, env: dict | None = None
               ) -> subprocess.Popen:
        """`sbatch --wait` of script with its arguments, run in out (its output in out/job.out); the interpreter is
        this one (--python for train.sbatch)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        cmd = ["sbatch", "--wait", f"--chdir={out}", f"--output={out / 'job.out'}", *sbatch_args, str(script),
               *script_args]
        return subprocess.Popen(cmd, env={**self.env, **(env or {})}, cwd=out, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def finish(self, p: subprocess.Popen, out: Path, timeout: float = 900) -> str:
        """The job's console (out/job.out) once sbatch returned; AssertionError with its marked lines if it failed."""
        try:
            said, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", "--full", *self.jobs()], env=self.env, timeout=60)
            said, _ = p.communicate(timeout=120)
        log = Path(out) / "job.out"
        console = log.read_text() if log.exists() else ""
        assert p.returncode == 0, failure_report(f"{said}\n{console}")
        return console

    def jobs(self) -> list[str]:
        proc = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True, timeout=60)
        return proc.stdout.split()


def process_env(pid: int) -> dict:
    """A process's environment (how a test tells on which slurm node and with which GPUs a process of a job runs:
    SLURMD_NODENAME, SLURM_STEP_GPUS, CUDA_VISIBLE_DEVICES)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


def leftovers(marker: str) -> list[str]:
    """Command lines of live processes that mention marker (a run's folder): what a finished job left behind."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                found.append(f"{proc.name}: {cmd[:200]}")
    return found


PYTHON = sys.executable
