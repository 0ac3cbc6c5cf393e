"""verl's actor-rollout worker on the CPU platform: the default process group made with plain "gloo" first.

verl's `TrainingWorker.__init__` calls `initialize_global_process_group_ray`, whose default backend is
`cpu:gloo,{device}:{backend}`; on our CPU platform that is `cpu:gloo,cpu:gloo`, which torch refuses ("Duplicate
device type cpu"). verl skips that call when a group already exists, so this subclass creates it with "gloo"
(rank, world size and rendezvous from the env verl's RayWorkerGroup sets) before verl's own `__init__`. The task
runner (`task_runner.py`) selects it only when the CPU platform is selected; on any other platform it is unused.
"""
from __future__ import annotations

import os

import torch.distributed as dist
from verl.workers.engine_workers import ActorRolloutRefWorker

from .platform_cpu import NAME


def cpu_platform_selected() -> bool:
    """True when the caller picked our CPU platform (VERL_PLATFORM=moe_lora_cpu); verl never auto-detects it."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == NAME


def init_gloo_process_group() -> None:
    """The default group on gloo from verl's worker env (RANK, WORLD_SIZE, MASTER_ADDR/PORT); once per process."""
    if not cpu_platform_selected():
        raise ValueError(f"the gloo-only worker is for VERL_PLATFORM={NAME}, got "
                         f"VERL_PLATFORM={os.environ.get('VERL_PLATFORM', '')!r}")
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)),
                                init_method=os.environ.get("DIST_INIT_METHOD", None))


class CPUActorRolloutRefWorker(ActorRolloutRefWorker):
    """`ActorRolloutRefWorker` with the default process group on gloo (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        init_gloo_process_group()
        super().__init__(*args, **kwargs)
