"""Megatron+LoRA (trained at given layouts) -> PEFT -> InprocTransport -> vLLM CPU engine: per-token logprob
agreement, and refusal of bad pushes. Used by tests/e2e/test_refit_vllm.py and the refit bench."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..lora import LoRAConfig
from ..checks.launch import worker_env
from . import lora_layouts


def run_vllm_worker(model: str, blobs: dict[str, Path], data: Path, cfg: LoRAConfig, cwd: Path) -> dict:
    args = [sys.executable, "-m", "moe_lora_rl.bench.refit_vllm_worker", "--model", model, "--blobs",
            ",".join(f"{k}={v}" for k, v in blobs.items()), "--data", str(data), "--rank", str(cfg.rank),
            "--alpha", str(cfg.alpha)]
    proc = subprocess.run(args, env=worker_env(), cwd=cwd, capture_output=True, text=True, timeout=1200)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM refit worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def check(models: list[str], layouts: list[str], cfg: LoRAConfig, workdir: Path) -> dict:
    lora_layouts.run(models, ",".join([lora_layouts.REFERENCE] + layouts), cfg, workdir)
    return {m: run_vllm_worker(m, {l: workdir / f"{l}-m{i}.pt" for l in layouts}, workdir / "data.pt", cfg, workdir)
            for i, m in enumerate(models)}
