"""The calibration runs of bench plan: one core's matmul ceiling, and the rollout and training workers
(bench/workers/plan_rollout_worker.py, plan_train_worker.py) timed at each batch size in one run."""
from __future__ import annotations

import json
import time


def matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """Single-thread fp32 matmul FLOP/s (best of `repeats`): the compute ceiling of one CPU core."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - t0)
    return 2 * n ** 3 / best


def measure(model: str, batches: list[int], prompt_len: int, response_len: int, rank: int, repeats: int) -> dict:
    from ...checks.torchrun import run_process, run_torchrun
    from ...lora import LoRAConfig

    conc = ",".join(map(str, batches))
    roll = run_process("moe_lora_rl.bench.workers.plan_rollout_worker",
                       ["--model", model, "--concurrency", conc, "--prompt-len", str(prompt_len), "--response-len",
                        str(response_len), "--repeats", str(repeats)], timeout=1800, what="plan rollout worker")
    train = run_torchrun("moe_lora_rl.bench.workers.plan_train_worker", 1,
                         ["--model", model, "--lora", json.dumps(LoRAConfig(rank=rank, alpha=2.0 * rank).to_dict()),
                          "--batches", conc, "--seq", str(prompt_len + response_len), "--repeats", str(repeats)])
    return {"rollout": roll, "train": train}
