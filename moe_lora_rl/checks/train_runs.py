"""The main job (moe_lora_rl.train) as a test or a bench launches it: under torchrun in its own process group, its
outputs read back, its engine process found (to kill it on purpose).

    p = start_train(out_dir, ["steps=4", "mode=async"], nproc=2)
    kill_engine_after_step(out_dir, p, 1)                 # SIGKILL of the engine once step 1 is logged
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

from .launch import free_port, worker_env


def train_command(out: Path, extra=(), nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "moe_lora_rl.train", *extra,
            f"out_dir={out}"]


def start_train(out: Path, extra=(), nproc: int = 2, env: dict | None = None) -> subprocess.Popen:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(train_command(out, extra, nproc), env=env or worker_env(), cwd=out,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_train(p: subprocess.Popen, out: Path, timeout: float = 900) -> tuple[dict, list[dict], str]:
    """The run's summary, its per-step records (step >= 1) and its console output; AssertionError if it failed."""
    stdout, stderr = p.communicate(timeout=timeout)
    assert p.returncode == 0, (stdout + stderr)[-4000:]
    out = Path(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((out / "summary.json").read_text()), [r for r in rows if r["step"] >= 1], stdout + stderr


def engine_pid(out: Path) -> int:
    """The engine process of the run in `out` (its log names its port; its command line carries the port)."""
    port = next(Path(out).glob("rollout-engine-*.log")).stem.rsplit("-", 1)[1]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"moe_lora_rl.rollout.server" in cmd and port.encode() in cmd:
                return int(proc.name)
    raise AssertionError(f"no engine process on port {port}")


def kill_engine_after_step(out: Path, p: subprocess.Popen, step: int, timeout: float = 600) -> None:
    t0 = time.time()
    log = Path(out) / "metrics.jsonl"
    while time.time() - t0 < timeout and p.poll() is None:
        if log.exists() and any(json.loads(line)["step"] >= step for line in log.read_text().splitlines()
                                if line.strip()):
            os.kill(engine_pid(out), signal.SIGKILL)
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} was not logged (driver exit code {p.poll()})")
