"""The main job's processes found and killed on purpose (the fault tests: tests/e2e/test_train.py,
test_async.py, tests/cluster): an engine of a run, a trainer rank, once a step is logged.

    p = start_train(out_dir, ["steps=4", "mode=async"], nproc=2, torchrun=["--max-restarts=1"])   # checks/train_runs.py
    kill_engine_after_step(out_dir, p, 1)                 # SIGKILL of an engine once step 1 is logged
    kill_rank_after_step(out_dir, p, 2, rank=1)           # SIGKILL of a trainer rank (torchrun restarts the group)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path


def _processes():
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                yield int(proc.name), (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue


def engine_pid(out: Path) -> int:
    """An engine process of the run in `out` (a live one whose log is there: the log names its port, its command
    line carries the port)."""
    ports = {f.stem.rsplit("-", 1)[1].encode() for f in Path(out).glob("rollout-engine-*.log")}
    for pid, cmd in _processes():
        if b"moe_lora_rl.rollout.server" in cmd and ports & set(cmd):
            return pid
    raise AssertionError(f"no engine process on ports {sorted(ports)}")


def rank_pid(out: Path, rank: int) -> int:
    """The trainer process of `rank` of the run in `out` (its command line names out_dir, its environment RANK)."""
    for pid, cmd in _processes():
        if b"moe_lora_rl.train" in cmd and f"out_dir={out}".encode() in cmd:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and any(e.startswith(b"TORCHELASTIC_RESTART_COUNT=") for e in env):
                return pid                    # a worker (torchrun's agent has the same command line, no RANK)
    raise AssertionError(f"no trainer process of rank {rank} for {out}")


def wait_for_step(out: Path, p: subprocess.Popen, step: int, timeout: float = 600) -> None:
    t0 = time.time()
    log = Path(out) / "metrics.jsonl"
    while time.time() - t0 < timeout and p.poll() is None:
        if log.exists() and any(json.loads(line)["step"] >= step for line in log.read_text().splitlines()
                                if line.strip()):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} was not logged (driver exit code {p.poll()})")


def kill_engine_after_step(out: Path, p: subprocess.Popen, step: int, timeout: float = 600) -> None:
    wait_for_step(out, p, step, timeout)
    os.kill(engine_pid(out), signal.SIGKILL)


def kill_rank_after_step(out: Path, p: subprocess.Popen, step: int, rank: int, timeout: float = 600) -> None:
    wait_for_step(out, p, step, timeout)
    os.kill(rank_pid(out, rank), signal.SIGKILL)
