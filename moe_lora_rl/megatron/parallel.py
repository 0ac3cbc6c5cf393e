"""Process groups for a layout: the world-size and host checks run before any group is created, so a bad layout or
a device the machine lacks is a ValueError instead of a hang."""
from __future__ import annotations

import os

import torch.distributed as dist

from .layout import Layout
from .run_config import RunConfig, parallel_state_kwargs, process_group_kwargs


CUDA_RNG_SEED = 1234               # megatron's default --seed


def init_distributed(layout: Layout, rc: RunConfig | None = None) -> None:
    """init_process_group (rc's backend, from torchrun's env) and megatron-core's parallel state for `layout`."""
    rc = rc or RunConfig()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout.check_world_size(world)
    rc.check_host()
    if not dist.is_initialized():
        alone = "MASTER_ADDR" not in os.environ       # a single process without torchrun: an in-memory store, no
        if alone:                                     # port to race other processes for
            os.environ.update(RANK="0", WORLD_SIZE="1")
        if rc.device == "cuda":
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kw = process_group_kwargs(rc)
        store = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else restart_store(kw["timeout"])
        dist.init_process_group(**kw, **store)
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp, **parallel_state_kwargs(rc))
    if rc.device == "cuda":          # the CUDA RNG tracker's states (attention dropout forks them, even at p=0); on
        from megatron.core import tensor_parallel      # the CPU, megatron-core's CPU support makes the fork a no-op

        tensor_parallel.model_parallel_cuda_manual_seed(CUDA_RNG_SEED)


def restart_store(timeout) -> dict:
    """Under a single-node torchrun with the agent's store (static and c10d rendezvous alike), the store of this
    restart attempt: the agent's TCPStore outlives a restart (--max-restarts), and gloo would read the dead ranks'
    addresses left there by the previous attempt (connection refused, or a hang); its keys are prefixed by the
    attempt instead. Several nodes (GROUP_WORLD_SIZE > 1), whose agents count restarts differently, and runs outside
    torchrun: {} (init_process_group's env:// default)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" \
            or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return {}         # several torchrun agents: a healthy node's agent restarts without counting (torch's agent)
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"moe_lora_rl/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": world}


def teardown() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    RouterReplay.global_router_replay_instances.clear()
