"""PEFT tensors -> canonical adapter factors -> a sharded Megatron model's LoRA (the inverse of rename.py; pure
planning plus one thin loader).

    from_peft_tensors   every canonical factor (global name and shape) assembled from the PEFT tensors it becomes
                        in rename.peft_outputs/place, run on position indices so the inverse is the same code as the
                        export: fused q/k/v and gate/up B factors are re-interleaved, an A copied to several HF
                        modules must be the same in each of them
    load_peft           this rank's slice of every factor of the model copied in (any layout); all factors are
                        checked before any is copied

A PEFT tensor no factor of the model reads (a module the Megatron LoRA does not target), a missing one, a wrong
shape, or copies of a shared factor that differ are ValueErrors naming the tensor.
"""
from __future__ import annotations

import math

import torch

from ..models.arch import MoEArch
from .rename import peft_outputs, place


def from_peft_tensors(peft: dict[str, torch.Tensor], arch: MoEArch,
                      shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """shapes: canonical factor name -> global shape (the model's factors). Returns canonical fp32 factors."""
    out, used = {}, set()
    for factor, shape in sorted(shapes.items()):
        shape = tuple(shape)
        idx = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        flat = torch.zeros(math.prod(shape), dtype=torch.float32)
        seen = torch.zeros(math.prod(shape), dtype=torch.bool)
        for o in peft_outputs(arch, factor, shape):
            t = peft.get(o.name)
            if t is None:
                raise ValueError(f"PEFT tensor {o.name} (of adapter factor {factor}) is missing")
            if tuple(t.shape) != o.shape:
                raise ValueError(f"PEFT tensor {o.name} has shape {tuple(t.shape)}, adapter factor {factor} "
                                 f"{shape} needs {o.shape}")
            for region, pos in place(o, idx, 0, 1, None, arch):
                pos, vals = pos.reshape(-1), t[region].reshape(-1).float()
                again = seen[pos]
                if again.any() and not torch.equal(flat[pos][again], vals[again]):
                    raise ValueError(f"PEFT tensor {o.name} differs from the other copies of adapter factor "
                                     f"{factor} (a factor shared by fused modules or by experts must be the same "
                                     "in each)")
                flat[pos] = vals
                seen[pos] = True
            used.add(o.name)
        if not seen.all():
            raise ValueError(f"adapter factor {factor}: {int((~seen).sum())} values no PEFT tensor provides")
        out[factor] = flat.reshape(shape)
    extra = sorted(set(peft) - used)
    if extra:
        raise ValueError(f"{len(extra)} PEFT tensors have no adapter factor in the model (its LoRA does not target "
                         f"them), e.g. {extra[:3]}")
    return out


@torch.no_grad()
def load_peft(model, arch: MoEArch, peft: dict[str, torch.Tensor]) -> int:
    """Copy a PEFT adapter into this rank's LoRA factors (the model built with apply_lora at any layout; the
    adapter's scale is the model's LoRAConfig alpha / rank). Returns the number of local factors set."""
    from ..lora.layers import adapter_factors
    from ..lora.state import group_rank_size, slice_bounds

    params = list(adapter_factors(model))
    shapes = {p.lora_meta.global_name: tuple(p.lora_meta.global_shape) for _, p in params}
    every = _all_shapes(shapes)
    full = from_peft_tensors(peft, arch, every)
    staged = []
    for _, p in params:
        meta = p.lora_meta
        t = full[meta.global_name]
        if meta.shard_dim is not None:
            r, n = group_rank_size(meta.group)
            lo, hi = slice_bounds(meta, n, r)
            t = t.narrow(meta.shard_dim, lo, hi - lo)
        staged.append((p, t))
    for p, t in staged:
        p.copy_(t.reshape(p.shape).to(p.dtype))
    return len(staged)


def _all_shapes(local: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every factor of the whole model (all pipeline stages and expert-parallel ranks), so that a PEFT tensor of
    another rank's layer or expert is not taken for one the model lacks."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}
