"""Adapter-only state: gather global tensors, and a sharded checkpoint that loads at any other layout.

Canonical form: every factor has a global name (global layer and expert ids) and a global shape; a rank holds one
contiguous slice of it along `shard_dim` (or all of it). A checkpoint stores, from one owner per replica set, each
rank's slice with its (global shape, dim, start, stop); loading assembles whatever slice the new layout needs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from .config import LoRAConfig
from .grad_sync import process_group
from .layers import adapter_factors

META_KEY = "moe_lora_rl"          # the safetensors metadata key of a shard file's index (also checkpoint/)


def group_rank_size(name: str | None) -> tuple[int, int]:
    if name is None or not dist.is_initialized():
        return 0, 1
    g = process_group(name)
    return dist.get_rank(g), dist.get_world_size(g)


def slice_bounds(meta, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) along meta.shard_dim of the slice rank `rank` of `size` holds (the whole first dim if the factor
    is not sharded); an even split, as the LoRA layers shard (also read by checkpoint/ and refit/import_peft.py)."""
    if meta.shard_dim is None:
        return 0, meta.global_shape[0]
    n = meta.global_shape[meta.shard_dim] // size
    return rank * n, (rank + 1) * n


def is_owner(meta) -> bool:
    """One copy per replica set: rank 0 within every group the factor is replicated over (its reduce groups)."""
    return all(group_rank_size(g)[0] == 0 for g in meta.reduce)


@torch.no_grad()
def gather_adapters(model, check_replicas: bool = True, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full canonical tensors of every adapter factor in the model, on every rank (collective over the world);
    grads=True: of their gradients instead (zeros where a factor has none).

    Every rank ends up holding the whole adapter (plus pickled copies): a reference for tests at small scale. The
    refit and PEFT export paths stream instead (refit/gather.py), holding one bucket at a time.

    With check_replicas, copies of the same factor held by different ranks must be bitwise equal: a gradient
    reduction that missed a group shows up here."""
    local: dict[str, torch.Tensor] = {}
    for _, p in adapter_factors(model):
        meta = p.lora_meta
        src = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
        t = meta.canonical(src.detach()).float()
        if meta.shard_dim is not None:
            g = process_group(meta.group)
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(g))]
            dist.all_gather(parts, t.contiguous(), group=g)
            t = torch.cat(parts, dim=meta.shard_dim)
        local[meta.global_name] = t.clone()
    everything: list[dict] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    out: dict[str, torch.Tensor] = {}
    for part in everything:
        for k, v in part.items():
            if k in out:
                if check_replicas and not torch.equal(out[k], v):
                    raise AssertionError(f"replicas of adapter factor {k} differ (max diff "
                                         f"{(out[k] - v).abs().max().item():.3g}): a gradient reduction is missing")
            else:
                out[k] = v
    return dict(sorted(out.items()))


def save_sharded(model, out_dir: str | Path) -> None:
    """Each owner rank writes its slices to adapter-RANK.safetensors; rank 0 writes lora_config.json."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "lora_config.json").write_text(json.dumps(model.lora_config.to_dict(), indent=1))
    if dist.is_initialized():
        dist.barrier()
    tensors, index = {}, {}
    for _, p in adapter_factors(model):
        meta = p.lora_meta
        if not is_owner(meta):
            continue
        r, n = group_rank_size(meta.group)
        start, stop = slice_bounds(meta, n, r)
        key = f"{meta.global_name}@{start}"
        tensors[key] = meta.canonical(p.detach()).contiguous().clone()
        index[key] = {"name": meta.global_name, "global_shape": list(meta.global_shape), "dim": meta.shard_dim,
                      "start": start, "stop": stop}
    save_file(tensors, str(out / f"adapter-{rank:05d}.safetensors"), metadata={META_KEY: json.dumps(index)})
    if dist.is_initialized():
        dist.barrier()


def read_full(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], LoRAConfig]:
    """Every adapter factor of a checkpoint saved at any layout, assembled whole (global names and shapes, fp32),
    and its LoRA config, without a model; ValueError naming the factor when a slice is missing."""
    from safetensors import safe_open

    ckpt = Path(ckpt_dir)
    cfg_file = ckpt / "lora_config.json"
    if not cfg_file.exists():
        raise ValueError(f"{ckpt}: no lora_config.json, not a moe_lora_rl adapter checkpoint")
    full: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("adapter-*.safetensors")):
        with safe_open(f, "pt") as s:
            for key, info in json.loads(s.metadata()[META_KEY]).items():
                t = s.get_tensor(key).float()
                out = full.setdefault(info["name"], torch.full(info["global_shape"], float("nan")))
                if info["dim"] is None:
                    out.copy_(t)
                else:
                    out.narrow(info["dim"], info["start"], info["stop"] - info["start"]).copy_(t)
    if not full:
        raise ValueError(f"{ckpt}: no adapter-*.safetensors")
    for name, t in full.items():
        if torch.isnan(t).any():
            raise ValueError(f"{ckpt}: adapter {name} is only partly present in the checkpoint")
    return full, LoRAConfig.from_dict(json.loads(cfg_file.read_text()))


@torch.no_grad()
def load_sharded(model, ckpt_dir: str | Path) -> int:
    """Load a checkpoint saved at any layout into this rank's adapters. Checks config, names, shapes and coverage
    for every factor before copying any of them. Returns the number of factors loaded."""
    from safetensors import safe_open

    ckpt = Path(ckpt_dir)
    cfg_file = ckpt / "lora_config.json"
    if not cfg_file.exists():
        raise ValueError(f"{ckpt}: no lora_config.json, not a moe_lora_rl adapter checkpoint")
    model.lora_config.check_compatible(LoRAConfig.from_dict(json.loads(cfg_file.read_text())), str(ckpt))
    pieces: dict[str, list] = {}
    for f in sorted(ckpt.glob("adapter-*.safetensors")):
        with safe_open(f, "pt") as s:
            for key, info in json.loads(s.metadata()[META_KEY]).items():
                pieces.setdefault(info["name"], []).append((f, key, info))
    staged = []
    for pname, p in adapter_factors(model):
        meta = p.lora_meta
        have = pieces.get(meta.global_name)
        if not have:
            raise ValueError(f"{ckpt}: adapter {meta.global_name} (parameter {pname}) is missing from the checkpoint")
        if have[0][2]["global_shape"] != list(meta.global_shape):
            raise ValueError(f"{ckpt}: adapter {meta.global_name} has global shape {have[0][2]['global_shape']}, "
                             f"the model expects {list(meta.global_shape)}")
        r, n = group_rank_size(meta.group)
        start, stop = slice_bounds(meta, n, r)
        target = torch.full(meta.canonical(p.detach()).shape, float("nan"), dtype=torch.float32)
        for f, key, info in have:
            with safe_open(f, "pt") as s:
                t = s.get_tensor(key).float()
            d = info["dim"]
            if d is None:                                    # the checkpoint holds the whole factor
                target.copy_(t if meta.shard_dim is None else t.narrow(meta.shard_dim, start, stop - start))
                continue
            if meta.shard_dim is not None and meta.shard_dim != d:
                raise ValueError(f"{ckpt}: {meta.global_name} is sharded on dim {d}, the model shards dim "
                                 f"{meta.shard_dim}")
            need_lo, need_hi = (start, stop) if meta.shard_dim is not None else (0, meta.global_shape[d])
            lo, hi = max(need_lo, info["start"]), min(need_hi, info["stop"])
            if lo < hi:
                target.narrow(d, lo - need_lo, hi - lo).copy_(t.narrow(d, lo - info["start"], hi - lo))
        if torch.isnan(target).any():
            raise ValueError(f"{ckpt}: adapter {meta.global_name} is only partly present in the checkpoint")
        staged.append((p, target))
    for p, target in staged:
        p.copy_(target.reshape(p.shape).to(p.dtype))
    return len(staged)
