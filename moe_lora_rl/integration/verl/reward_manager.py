"""verl's reward manager with non-finite rewards refused (what the main job does with the same reward).

verl 0.9.1's NaiveRewardManager hands the score of `reward.custom_reward_function` (or verl's default scorers) to the
advantage estimator as it is: one NaN in a GRPO group makes every advantage of the group NaN, verl's token-mean loss
NaN, and the engine's non-finite rule then skips the whole optimizer step, so every other group's signal is lost
too, with only a NaN grad norm in the metrics. This manager is verl's naive one with one check after each score: a
non-finite score (NaN, +-inf, or a "score" entry of a dict result that is one) is a ValueError naming the data source,
the row (extra_info.index) and the value, so the run stops at the first bad reward instead of skipping steps.

    reward.reward_manager.source=importlib
    reward.reward_manager.name=FiniteRewardManager
    reward.reward_manager.module.path=pkg://moe_lora_rl.integration.verl.reward_manager

(recipes/verl_moe_lora/config/moe_lora.yaml sets these; config.check_config refuses verl's plain naive manager.)
"""
from __future__ import annotations

import math

from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

NAME = "FiniteRewardManager"
MODULE = "pkg://moe_lora_rl.integration.verl.reward_manager"


def check_finite(score, data_source, extra_info) -> None:
    """ValueError naming data source, row and value for a score that is not a finite number."""
    try:
        ok = math.isfinite(float(score))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        row = (extra_info or {}).get("index", "?") if hasattr(extra_info, "get") else "?"
        raise ValueError(f"reward of data source {data_source!r}, row {row}: {score!r} is not a finite number (the "
                         "reward function must return a float; a NaN would poison its GRPO group and skip the step)")


class FiniteRewardManager(NaiveRewardManager):
    async def run_single(self, data):
        out = await super().run_single(data)
        item = data[-1:][0]
        check_finite(out["reward_score"], item.non_tensor_batch["data_source"],
                     item.non_tensor_batch.get("extra_info", {}))
        return out
