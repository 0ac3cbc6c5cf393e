"""All-reduce adapter gradients over the groups their sharding rule names (sharding.py), bucketed per group set.

Called after backward, before the optimizer step. A factor whose expert saw no token still takes part (zero grad):
every rank of a group must join the same collectives in the same order.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from .layers import adapter_factors


def process_group(name: str):
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_group,
        "etp": ps.get_expert_tensor_parallel_group,
        "ep": ps.get_expert_model_parallel_group,
        "dp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        "edp": ps.get_expert_data_parallel_group,
    }[name]()


def sync_adapter_grads(model) -> None:
    buckets: OrderedDict[tuple[str, ...], list[torch.nn.Parameter]] = OrderedDict()
    for _, p in adapter_factors(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault(p.lora_meta.reduce, []).append(p)
    for groups, params in buckets.items():
        live = [g for g in groups if dist.get_world_size(process_group(g)) > 1]
        if not live:
            continue
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])
        for g in live:
            dist.all_reduce(flat, group=process_group(g))
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
