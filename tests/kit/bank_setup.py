"""In-process pieces of the adapter-bank tests (tests/unit/test_policy_bank*.py): the tiny GLM4-MoE in a world of
one (gloo, fp32), two batches of different data (b's advantages are -0.5 x a's), one PPO round of two mini-batches."""
from __future__ import annotations

import dataclasses


def tiny_world():
    """(the tiny model's path, the run config), the process group of one initialised."""
    from moe_lora_rl.megatron.layout import Layout
    from moe_lora_rl.megatron.parallel import init_distributed
    from moe_lora_rl.megatron.run_config import RunConfig, prepare_host
    from moe_lora_rl.models import get_model

    rc = RunConfig()
    prepare_host(rc)
    init_distributed(Layout(), rc)
    return str(get_model("glm4_moe", "tiny")), rc


def two_batches(arch) -> dict:
    from .minibatch_worker import make_batch

    batch, _ = make_batch(arch)
    return {"a": batch, "b": dataclasses.replace(batch, advantages=-0.5 * batch.advantages)}


def ppo_round(pol, batch) -> None:
    """One update of two PPO mini-batches, the rollout logprobs the policy's own replayed recompute."""
    from moe_lora_rl.rl.trainer_step import train_on
    from .minibatch_worker import cfg

    b = dataclasses.replace(batch, rollout_logprobs=pol.logprobs(batch, replay="r3").logprobs)
    train_on(pol, cfg(2, 1), b)
