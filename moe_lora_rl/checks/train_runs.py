"""The main job (moe_lora_rl.train) as a test or a bench launches it: under torchrun in its own process group, its
outputs read back, its engine process found (to kill it on purpose).

    p = start_train(out_dir, ["steps=4", "mode=async"], nproc=2, torchrun=["--max-restarts=1"])
    kill_engine_after_step(out_dir, p, 1)                 # SIGKILL of an engine once step 1 is logged
    kill_rank_after_step(out_dir, p, 2, rank=1)           # SIGKILL of a trainer rank (torchrun restarts the group)
    summary, records, log = finish_train(p, out_dir)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..procs import free_port
from .launch import worker_env


def train_command(out: Path, extra=(), nproc: int = 2, torchrun=(), launcher: bool = False) -> list[str]:
    """torchrun's command, or with launcher=True `moe-lora-rl train` (its checks, then the same ranks)."""
    if launcher:
        assert not torchrun, "the launcher takes no torchrun flags"
        return [sys.executable, "-m", "moe_lora_rl.cli", "train", f"--nproc-per-node={nproc}", *extra,
                f"out_dir={out}"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", *torchrun, "-m", "moe_lora_rl.train",
            *extra, f"out_dir={out}"]


def start_train(out: Path, extra=(), nproc: int = 2, env: dict | None = None, torchrun=(),
                launcher: bool = False) -> subprocess.Popen:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(train_command(out, extra, nproc, torchrun, launcher), env=env or worker_env(), cwd=out,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_train(p: subprocess.Popen, out: Path, timeout: float = 900) -> tuple[dict, list[dict], str]:
    """The run's summary, its per-step records (step >= 1) and its console output; AssertionError if it failed."""
    stdout, stderr = p.communicate(timeout=timeout)
    out = Path(out)
    (out / "console.log").write_text(stdout + stderr)
    assert p.returncode == 0, failure_report(stdout + stderr)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((out / "summary.json").read_text()), [r for r in rows if r["step"] >= 1], stdout + stderr


def failure_report(console: str, tail: int = 3000) -> str:
    """What a failed run printed, for an assertion message: every line that tells of a restart, a dead process or an
    error, from the whole console (the first failure is often far from the end), then its tail."""
    marks = ("restart", "died", "Error", "error:", "FAILED", "exitcode", "Signal ")
    lines = [line for line in console.splitlines() if any(m in line for m in marks)]
    return "\n".join(["-- marked lines --", *lines[:80], "-- tail --", console[-tail:]])


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
