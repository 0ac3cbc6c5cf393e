"""R3 check driver: a bf16 rollout (HF transformers stand-in) records routes and logprobs; Megatron (fp32) at each
layout recomputes without and with replay."""
from __future__ import annotations

from pathlib import Path

import torch

from ..testing.launch import run_torchrun
from .common import group_by_world


def make_rollout(models: list[str], out: Path, n: int = 8, s: int = 64, seed: int = 3) -> None:
    import transformers

    from ..testing.hf_routes import hf_rollout_routes

    data = {}
    for m in models:
        hf = transformers.AutoModelForCausalLM.from_pretrained(m, dtype=torch.bfloat16).eval()
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, hf.config.vocab_size, (n, s), generator=g)
        routes, lps = hf_rollout_routes(hf, list(tokens))
        data[m] = {"tokens": tokens, "routes": routes.to_field(), "num_experts": routes.num_experts,
                   "logprobs": lps, "bytes_per_token": routes.bytes_per_token}
    torch.save(data, out / "rollout.pt")


def make_rollout_vllm(models: list[str], out: Path, overhead_batches: int = 0) -> None:
    import subprocess
    import sys

    from ..testing.launch import worker_env

    args = [sys.executable, "-m", "moe_lora_rl.bench.rollout_vllm_worker", "--models", ",".join(models),
            "--out", str(out / "rollout.pt"), "--overhead-batches", str(overhead_batches)]
    proc = subprocess.run(args, env=worker_env(), cwd=out, capture_output=True, text=True, timeout=2400)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM rollout worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def run(models: list[str], layouts: str, workdir: Path, engine: str = "hf", overhead_batches: int = 0,
        timing: int = 0) -> dict:
    """engine: "vllm" (bf16 rollouts with routing capture) or "hf" (HF transformers bf16 stand-in)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if engine == "vllm":
        make_rollout_vllm(models, workdir, overhead_batches)
    elif engine == "hf":
        make_rollout(models, workdir)
    else:
        raise ValueError(f"engine={engine!r}; choose 'vllm' or 'hf'")
    res: dict = {}
    for world, names in group_by_world(layouts).items():
        res.update(run_torchrun("moe_lora_rl.bench.replay_worker", world,
                                ["--models", ",".join(models), "--layouts", ",".join(names),
                                 "--data", str(workdir / "rollout.pt"), "--timing", str(timing)]))
    return res
