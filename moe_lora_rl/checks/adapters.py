"""Adapters set to known nonzero values for a check (B = 0 at init would make every adapter path vanish)."""
from __future__ import annotations

import torch


@torch.no_grad()
def randomize_adapters(model, seed: int, scale: float = 1.0, b_scale: float = 1.0) -> None:
    """Every factor set from a seeded global tensor named by its global name (kaiming-uniform on fan-in), so every
    layout and replica holds the same adapter; all factors times `scale`, lora_B factors also times `b_scale`."""
    from ..lora.layers import adapter_factors, make_factor
    from ..lora.state import group_rank_size

    for _, p in adapter_factors(model):
        meta = p.lora_meta
        r, n = group_rank_size(meta.group)
        new = make_factor(meta, r, n, init="kaiming", seed=seed, dtype=p.dtype) * scale
        p.copy_(new * b_scale if meta.global_name.endswith("lora_B") else new)
