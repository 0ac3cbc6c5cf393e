"""What our verl engine's weight stream holds on each trainer rank (tests/distributed/test_verl_engine.py): verl's
colocated sync hands each rank's stream to its own rollout worker, so every rank must yield the same whole version."""
from __future__ import annotations

import torch


def stream_check(engine) -> dict:
    """Every trainer rank's get_per_tensor_param stream (verl's colocated call): its tensor count and a digest of its
    names and bytes, gathered from every rank. verl hands each rank's stream to its own rollout worker, so every rank
    must yield the same whole version (the digest is also compared across layouts by the test)."""
    import hashlib

    import torch.distributed as dist

    gen, _ = engine.get_per_tensor_param(layered_summon=False, base_sync_done=True)
    tensors = {name: t for name, t in gen if name != "moe_lora.meta"}   # bucket order follows the layout's plan
    h, n = hashlib.sha256(), len(tensors)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (n, h.hexdigest()))
    return {"stream_tensors": [c for c, _ in got], "stream_digests": [d for _, d in got]}
