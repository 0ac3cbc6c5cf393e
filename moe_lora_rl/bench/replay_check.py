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


def run(models: list[str], layouts: str, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    make_rollout(models, workdir)
    res: dict = {}
    for world, names in group_by_world(layouts).items():
        res.update(run_torchrun("moe_lora_rl.bench.replay_worker", world,
                                ["--models", ",".join(models), "--layouts", ",".join(names),
                                 "--data", str(workdir / "rollout.pt")]))
    return res
