"""Process groups for a layout: the world-size and host checks run before any group is created, so a bad layout or
a device the machine lacks is a ValueError instead of a hang."""
from __future__ import annotations

import datetime
import os
from typing import Callable, TypeVar

import torch.distributed as dist

from .layout import Layout
from .run_config import RunConfig, parallel_state_kwargs, process_group_kwargs


CUDA_RNG_SEED = 1234               # megatron's default --seed
RANK0_WAIT = datetime.timedelta(days=1)
"""How long from_rank0's other ranks wait for rank 0 (a warm start trained before the run may take hours; the
process group's own timeout, run_config.PG_TIMEOUT, is 10 minutes). torchrun stops them at once if rank 0 dies."""
T = TypeVar("T")


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


def from_rank0(fn: Callable[[], T], what: str, timeout: datetime.timedelta = RANK0_WAIT) -> T:
    """fn() run on rank 0 alone, its result on every rank; after init_distributed. The other ranks wait for it in a
    broadcast on a gloo group of its own whose timeout is `timeout`, not the process group's PG_TIMEOUT, so rank 0
    may take longer than that (e.g. training the run's warm start). If fn raises on rank 0, rank 0 raises it and
    every other rank raises RuntimeError('rank 0 failed to {what}: {type}: {message}'), one line."""
    if dist.get_world_size() == 1:
        return fn()
    group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        box, error = [None], None
        if dist.get_rank() == 0:
            try:
                box[0] = ("ok", fn())
            except Exception as e:                 # noqa: BLE001 - every rank must learn it, rank 0 raises it below
                error = e
                box[0] = ("error", " ".join(f"{type(e).__name__}: {e}".split()))
        dist.broadcast_object_list(box, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "error":
        raise RuntimeError(f"rank 0 failed to {what}: {value}")
    return value


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
