"""The main job (moe_lora_rl.train) as a test or a bench launches it: under torchrun in its own process group, its
outputs read back (a failed run's console marked); the fault tests kill its processes with tests/kit/train_faults.py.

    p = start_train(out_dir, ["steps=4", "mode=async"], nproc=2, torchrun=["--max-restarts=1"])
    summary, records, log = finish_train(p, out_dir)
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..procs import free_port
from .torchrun import worker_env


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
