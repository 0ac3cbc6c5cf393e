"""Process groups for a layout on gloo: the world-size check runs before any group is created, so a bad layout is
a ValueError instead of a hang."""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from .layout import Layout


def init_distributed(layout: Layout) -> None:
    """init_process_group("gloo") (from torchrun's env) and megatron-core's parallel state for `layout`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout.check_world_size(world)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:          # a single process without torchrun
            from ..testing.launch import free_port

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=False)


def teardown() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    RouterReplay.global_router_replay_instances.clear()
