"""python -m moe_lora_rl.bench grpo_hf --json: GRPO with LoRA in plain HF transformers + peft on one process, from the
warm-started default model on the synthetic task: held-out success against RL seconds, the reference curve the
Megatron + vLLM run is measured against.

    sample G responses per prompt (HF generate, temperature 1) -> score -> verl GRPO advantages -> verl PPO-clip
    loss (on-policy: one update per batch) -> AdamW on the LoRA factors (experts + attention): runners/hf_grpo.py

Timing: rl_s is the wall time of rollout + update only (held-out evaluation excluded), rl_cpu_s its process CPU time
with torch on --threads threads (on a loaded machine the CPU time is the better measure of the work).
"""
from __future__ import annotations

import argparse
import sys


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench grpo_hf")
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the warm-started glm4_moe small)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--time-budget", type=float, default=600.0, help="stop after this many RL seconds (wall)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--n-eval", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for k in ("steps", "prompts", "group", "rank", "eval_every", "n_eval", "threads"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')}={getattr(a, k)} must be >= 1")
    if a.group < 2:
        p.error(f"--group={a.group} must be >= 2")
    if a.lr < 0 or a.time_budget <= 0:
        p.error("--lr must be >= 0 and --time-budget > 0")
    return a


def main(argv=None) -> None:
    from .emit import emit
    from .runners.hf_grpo import run

    a = _args(argv if argv is not None else sys.argv[1:])
    emit(run(a), a.json)


if __name__ == "__main__":
    main()
