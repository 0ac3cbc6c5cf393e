"""long: the long-reasoning job (recipes/long.yaml: data.task=sort_long, the written selection sort with a final
result line, list sizes from a skewed mix; PPO mini-batches) and, in the same run, the same job with algo.lr=0 as a
control; each under torchrun on this machine.

    python -m moe_lora_rl.bench long --json [--model DIR] [--layouts tp1ep1pp1] [--nproc 2] [--steps N] [-- k=v ...]

len_p10/p50/p90/max: response lengths (tokens) of the warm-started model on the held-out problems (the run's first
evaluation, one sample each at temperature 1). s_per_step: RL seconds per step without the evaluations.
Targets on 2 cores: len_p50 >= 100, len_p90 >= 250, len_max near 400; warmup_s <= 600; eval_start in [0.15, 0.40];
eval_end - eval_start >= 0.15 while |eval_end_lr0 - eval_start| <= 0.03; clipfrac_mean > 0 (several mini-steps).
"""
from __future__ import annotations

from . import e2e

RECIPE = ["--config-name=long"]
KEYS = ("len_p10", "len_p50", "len_p90", "len_max", "warmup_s", "warmup_cached", "eval_start", "eval_end",
        "s_per_step", "clipfrac_mean", "reward_start", "reward_end", "response_len_mean", "kl_mean_r3",
        "kl_mean_no_r3", "ratio_gt2", "ratio_gt2_no_r3", "seq_ratio_gt2_r3", "seq_ratio_gt2_no_r3",
        "grad_norm_mean", "wall_s", "steps")


def main(argv=None) -> dict:
    return e2e.main(argv, name="long", doc=__doc__, recipe=RECIPE, keys=KEYS)
