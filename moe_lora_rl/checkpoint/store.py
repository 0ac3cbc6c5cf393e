"""Training checkpoints of a LoRA policy: sharded adapters, their AdamW state sharded the same way, and the caller's
run state (step, adapter version, data position, RNG states, scheduler), loadable at any other layout.

    save:  all ranks write into ROOT/.tmp-step-N/ -> each rank hashes its files -> rank 0 writes manifest.json last
           -> rename to ROOT/step-N/ -> ROOT/latest (written by rename) names it
    load:  latest -> manifest -> run identity and LoRA config -> sha256 of every file -> plan the reads of this
           rank's slices (ckpt_plan.plan_reads) -> only when every rank found everything: copy into the model and
           the optimizer

A crash mid-save leaves at most a .tmp- directory that `latest` never names; a refusal (a one-line ValueError
naming the file and the mismatch, the same on every rank) changes neither the model, the optimizer nor any file.
Adam's moments have their parameter's shape and sharding, so they are stored as slices of the global canonical
tensor exactly like the adapters (lora/state.py's format: the step directory also loads with lora.load_sharded).

Exact resume, in this order:
    meta = describe_run(model_path, lora, layout, seed=cfg.seed, algo=...)   # what must not change across a resume
    after step k (update, push, metrics logged): save_checkpoint(root, k, model, optimizer, run_meta=meta,
        state={"step": k, "version": policy.version, "rng": rng_state(), ...})
    on resume, after building the model and optimizer, before the first push:
        state = load_checkpoint(root, model, optimizer, run_meta=meta); set_rng_state(state["rng"])
        policy.version = state["version"]; (re)start the engine; push that version; continue with step k + 1
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..lora.config import LoRAConfig
from ..lora.layers import adapter_factors
from ..lora.state import _META_KEY, _slice_bounds, group_rank_size, is_owner, save_sharded
from .plan import (FORMAT, LATEST, MANIFEST, Piece, check_file, check_run_meta, plan_reads, sha256_file,
                        step_dir_name, step_of)

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
OPTIMIZER_FILE = "optimizer.json"


# ---- run identity and RNG state -------------------------------------------------------------------------------

def describe_run(model_path, lora: LoRAConfig, layout=None, **extra) -> dict:
    """run_meta for save/load: the model (resolved path + sha256 of its config.json), the LoRA config and the
    layout (recorded, not checked: a checkpoint loads at any layout). Extra keys must match exactly on load."""
    path = Path(model_path).resolve()
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ValueError(f"model path {str(model_path)!r} has no config.json")
    meta = {"model": {"path": str(path), "config_sha256": sha256_file(cfg)}, "lora": lora.to_dict()}
    if layout is not None:
        meta["layout"] = getattr(layout, "name", str(layout))
    return {**meta, **extra}


def rng_state() -> dict:
    """This process's python, numpy and torch RNG states (for `state`; restore with set_rng_state)."""
    import numpy as np

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(s: dict) -> None:
    import numpy as np

    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


# ---- helpers ----------------------------------------------------------------------------------------------------

def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(error: str | None) -> None:
    """Every rank raises the same ValueError if any rank found one (so no rank copies while another refuses)."""
    errors = [e for e in _gather(error) if e]
    if errors:
        raise ValueError(errors[0])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))
    _fsync(path)


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, tuple):
        return list(v)
    return v


def _optimizer_params(optimizer) -> list[list[torch.nn.Parameter]]:
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if not hasattr(p, "lora_meta"):
                raise ValueError(f"optimizer param group {gi} holds a parameter of shape {list(p.shape)} that is "
                                 "not an adapter factor; checkpoints hold adapter factors only")
        groups.append(list(g["params"]))
    return groups


def _local_slice(meta) -> tuple[int, int]:
    """[start, stop) of this rank's slice along the factor's shard dim (the whole dim 0 when replicated)."""
    rank, size = group_rank_size(meta.group)
    return _slice_bounds(meta, size, rank)


# ---- save -------------------------------------------------------------------------------------------------------

def save_checkpoint(root, step: int, model, optimizer, *, run_meta: dict, state: dict) -> Path:
    """Save at `step` (all ranks call it, with their own `state`); returns ROOT/step-NNNNNNNN. `optimizer`: the
    torch AdamW over the model's adapter factors (None: adapters only)."""
    from safetensors.torch import save_file

    rank, world = _rank_world()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):          # debris of a crashed save; latest never names it
            shutil.rmtree(stale)
        tmp.mkdir()
    _barrier()
    save_sharded(model, tmp)                           # adapter-RANK.safetensors + lora_config.json (barriers)
    mine = [f"adapter-{rank:05d}.safetensors"]

    opt_local = None
    if optimizer is not None:
        groups = _optimizer_params(optimizer)
        tensors, index, steps = {}, {}, {}
        for p in (p for g in groups for p in g):
            meta, st = p.lora_meta, optimizer.state.get(p, {})
            if not is_owner(meta) or not st:
                continue
            start, stop = _local_slice(meta)
            steps[meta.global_name] = {"value": float(st["step"]), "dtype": str(st["step"].dtype).split(".")[-1]} \
                if torch.is_tensor(st["step"]) else {"value": float(st["step"]), "dtype": None}
            for kind in MOMENTS:
                if kind in st:
                    key = f"{kind}/{meta.global_name}@{start}"
                    tensors[key] = meta.canonical(st[kind].detach()).contiguous().clone()
                    index[key] = {"name": meta.global_name, "kind": kind, "global_shape": list(meta.global_shape),
                                  "dim": meta.shard_dim, "start": start, "stop": stop}
        f = tmp / f"optim-{rank:05d}.safetensors"
        save_file(tensors, str(f), metadata={_META_KEY: json.dumps(index)})
        mine.append(f.name)
        opt_local = {"names": [[p.lora_meta.global_name for p in g] for g in groups], "steps": steps,
                     "has_state": any(optimizer.state.get(p) for g in groups for p in g)}
    f = tmp / f"state-{rank:05d}.pt"
    torch.save(state, f)
    mine.append(f.name)
    for name in mine:
        _fsync(tmp / name)
    digests = {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)} for name in mine}
    everything = _gather((digests, opt_local))

    if rank == 0:
        files = {}
        for d, _ in everything:
            files.update(d)
        if optimizer is not None:
            groups_meta = []
            for gi, g in enumerate(optimizer.param_groups):
                names = sorted({n for _, o in everything for n in o["names"][gi]})
                groups_meta.append({"hyper": {k: _jsonable(v) for k, v in g.items() if k != "params"},
                                    "names": names})
            steps = {}
            for _, o in everything:
                steps.update(o["steps"])
            _write_json(tmp / OPTIMIZER_FILE, {"class": type(optimizer).__name__, "groups": groups_meta,
                                               "steps": steps,
                                               "has_state": any(o["has_state"] for _, o in everything)})
        for name in ("lora_config.json",) + ((OPTIMIZER_FILE,) if optimizer is not None else ()):
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        _write_json(tmp / MANIFEST, {"format": FORMAT, "step": step, "world_size": world, "run_meta": run_meta,
                                     "lora_config": model.lora_config.to_dict(),
                                     "optimizer": optimizer is not None, "files": files})
        _fsync(tmp)
        old = root / f".old-{final.name}"
        if final.exists():                              # the same step saved again (a resumed run)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(root)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        _fsync(pointer)
        os.replace(pointer, root / LATEST)
        _fsync(root)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return final


def prune(root, keep: int) -> list[str]:
    """Rank 0 removes step directories under ROOT beyond the newest `keep` (never the one `latest` names); all ranks
    call it. Returns the removed names."""
    if keep < 1:
        raise ValueError(f"keep={keep}: at least the latest checkpoint is kept")
    rank, _ = _rank_world()
    removed = []
    if rank == 0:
        root = Path(root)
        latest = latest_step(root)
        steps = sorted(s for s in (step_of(p.name) for p in root.iterdir() if p.is_dir()) if s is not None)
        for s in steps[:-keep]:
            if s != latest:
                shutil.rmtree(root / step_dir_name(s))
                removed.append(step_dir_name(s))
    _barrier()
    return removed


# ---- load -------------------------------------------------------------------------------------------------------

def latest_step(root) -> int | None:
    """The step `latest` names, or None when ROOT has no checkpoint."""
    p = Path(root) / LATEST
    return step_of(p.read_text().strip()) if p.is_file() else None


def _find(root: Path, step: int | None) -> Path:
    if step is None:
        pointer = root / LATEST
        if not pointer.is_file():
            raise ValueError(f"{pointer}: no checkpoint to resume from (no '{LATEST}' file in {root})")
        name = pointer.read_text().strip()
        if step_of(name) is None:
            raise ValueError(f"{pointer}: names {name!r}, not a step-NNNNNNNN directory")
    else:
        name = step_dir_name(step)
    ckpt = root / name
    if not ckpt.is_dir():
        raise ValueError(f"{ckpt}: no such checkpoint directory")
    return ckpt


def _read_manifest(ckpt: Path) -> dict:
    f = ckpt / MANIFEST
    if not f.is_file():
        raise ValueError(f"{f}: missing, the checkpoint is incomplete")
    try:
        m = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: unreadable ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{f}: format {m.get('format') if isinstance(m, dict) else None!r}, expected {FORMAT!r}")
    return m


def _pieces(ckpt: Path, files: list[str]) -> dict[tuple[str, str], list[Piece]]:
    """(kind, global name) -> stored slices; kind "param" for adapters, else the moment's name."""
    from safetensors import safe_open

    out: dict[tuple[str, str], list[Piece]] = {}
    for name in files:
        with safe_open(str(ckpt / name), "pt") as s:
            index = json.loads((s.metadata() or {}).get(_META_KEY, "{}"))
        for key, info in index.items():
            piece = Piece(name, key, tuple(info["global_shape"]), info["dim"], info["start"], info["stop"])
            out.setdefault((info.get("kind", "param"), info["name"]), []).append(piece)
    return out


def _assemble(ckpt: Path, what: str, pieces, p: torch.nn.Parameter, cache: dict) -> torch.Tensor:
    from safetensors import safe_open

    meta = p.lora_meta
    lo, hi = _local_slice(meta)
    reads = plan_reads(f"{what} of adapter {meta.global_name}", pieces, tuple(meta.global_shape), meta.shard_dim,
                       lo, hi)
    out = torch.empty(meta.canonical(p.detach()).shape, dtype=p.dtype)
    for r in reads:
        if r.file not in cache:
            cache[r.file] = safe_open(str(ckpt / r.file), "pt")
        t = cache[r.file].get_tensor(r.key)
        if r.dim is None:
            out.copy_(t)
        else:
            out.narrow(r.dim, r.dst_lo, r.n).copy_(t.narrow(r.dim, r.src_lo, r.n))
    return out.reshape(p.shape)


def _stage(ckpt: Path, m: dict, model, optimizer, run_meta: dict) -> tuple[list, list, list, dict]:
    """Everything to copy, checked; raises ValueError before anything is changed."""
    rank, world = _rank_world()
    check_run_meta(m["run_meta"], run_meta, str(ckpt))
    model.lora_config.check_compatible(LoRAConfig.from_dict(m["lora_config"]), str(ckpt))
    names = sorted(m["files"])
    for i, name in enumerate(names):                   # hashing split over the ranks; _agree shares the verdict
        if i % world == rank:
            check_file(ckpt, name, m["files"][name])
    mine = f"state-{rank if rank < m['world_size'] else 0:05d}.pt"
    if mine not in m["files"]:
        raise ValueError(f"{ckpt / mine}: not listed in {ckpt / MANIFEST}")
    check_file(ckpt, mine, m["files"][mine])

    tensor_files = [n for n in names if n.endswith(".safetensors")]
    pieces = _pieces(ckpt, tensor_files)
    cache: dict = {}
    params = [(p, _assemble(ckpt, "weights", pieces.get(("param", p.lora_meta.global_name)), p, cache))
              for _, p in adapter_factors(model)]
    opt_states, hyper = [], []
    if optimizer is not None:
        if not m["optimizer"]:
            raise ValueError(f"{ckpt}: the checkpoint has no optimizer state (saved with optimizer=None)")
        o = json.loads((ckpt / OPTIMIZER_FILE).read_text())
        if o["class"] != type(optimizer).__name__:
            raise ValueError(f"{ckpt / OPTIMIZER_FILE}: optimizer {o['class']}, this run uses "
                             f"{type(optimizer).__name__}")
        groups = _optimizer_params(optimizer)
        if len(groups) != len(o["groups"]):
            raise ValueError(f"{ckpt / OPTIMIZER_FILE}: {len(o['groups'])} param groups, this run's optimizer "
                             f"has {len(groups)}")
        for gi, (g, saved) in enumerate(zip(groups, o["groups"])):
            extra = sorted({p.lora_meta.global_name for p in g} - set(saved["names"]))
            if extra:
                raise ValueError(f"{ckpt / OPTIMIZER_FILE}: param group {gi} lacks {extra[0]} "
                                 f"({len(extra)} adapter factors)")
            hyper.append({k: tuple(v) if isinstance(v, list) else v for k, v in saved["hyper"].items()})
            if not o["has_state"]:
                continue
            for p in g:
                name = p.lora_meta.global_name
                if name not in o["steps"]:                 # never stepped when saved (no gradient): none now
                    continue
                st = o["steps"][name]
                s = {"step": torch.tensor(st["value"], dtype=getattr(torch, st["dtype"])) if st["dtype"]
                     else st["value"]}
                for kind in MOMENTS:
                    if (kind, name) in pieces:
                        s[kind] = _assemble(ckpt, kind, pieces[(kind, name)], p, cache)
                opt_states.append((p, s))
    cache.clear()
    state = torch.load(ckpt / mine, weights_only=False)   # our own pickle, its sha256 checked above
    return params, opt_states, hyper, state


@torch.no_grad()
def load_checkpoint(root, model, optimizer, *, run_meta: dict, step: int | None = None) -> dict:
    """Load ROOT/latest (or step-`step`) into the model's adapters and the optimizer (None: adapters only), at any
    layout; returns this rank's saved `state` (at another world size, ranks beyond the saved world get rank 0's).
    All ranks call it. Refusals are one-line ValueErrors, raised on every rank, with nothing changed."""
    error, staged, ckpt = None, None, Path(root)
    try:
        ckpt = _find(Path(root), step)
        m = _read_manifest(ckpt)
        staged = _stage(ckpt, m, model, optimizer, run_meta)
    except ValueError as e:
        error = str(e).splitlines()[0]
    except Exception as e:                               # every rank must reach _agree, or the others hang
        error = f"{ckpt}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    _agree(error)
    params, opt_states, hyper, state = staged
    for p, t in params:
        p.copy_(t)
    if optimizer is not None:
        for g, h in zip(optimizer.param_groups, hyper):
            g.update(h)
        optimizer.state.clear()
        for p, s in opt_states:
            optimizer.state[p] = s
    return state
