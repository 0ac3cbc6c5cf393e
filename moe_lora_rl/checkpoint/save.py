"""Writing a checkpoint (all ranks): this rank's shards, the manifest last, the commit by rename; debris of a
crashed save tidied first (checkpoint/api.py describes the format and the guarantees)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from ..lora.layers import adapter_factors
from ..lora.state import META_KEY, is_owner
from .common import (MOMENTS, OPTIMIZER_FILE, _barrier, _crash_point, _fsync, _gather, _jsonable, _local_slice,
                     _optimizer_params, _raise_shared, _rank_world, _read_pointer, _write, _write_error, latest_step)
from .directory import (FORMAT, LATEST, LATEST_TMP, MANIFEST, OLD_PREFIX, TMP_PREFIX, plan_cleanup, sha256_file,
                        step_dir_name, step_of)





# ---- save -------------------------------------------------------------------------------------------------------

def _owned_slices(factors, kind: str | None, tensor_of) -> tuple[dict, dict]:
    """This rank's slices of the factors it owns (one owner per replica set), keyed "[KIND/]NAME@START", with
    lora/state.py's index (adapters carry no kind, so lora.load_sharded reads the step directory too)."""
    tensors, index = {}, {}
    for p in factors:
        meta, t = p.lora_meta, tensor_of(p)
        if t is None or not is_owner(meta):
            continue
        start, stop = _local_slice(meta)
        key = f"{kind + '/' if kind else ''}{meta.global_name}@{start}"
        tensors[key] = meta.canonical(t.detach()).contiguous().clone()
        index[key] = {"name": meta.global_name, "global_shape": list(meta.global_shape), "dim": meta.shard_dim,
                      "start": start, "stop": stop, **({"kind": kind} if kind else {})}
    return tensors, index


def _write_rank_files(tmp: Path, rank: int, model, optimizer, groups, state: dict) -> tuple[dict, dict | None]:
    """This rank's adapter-, optim- and state-RANK files (each fsynced): their digests and the optimizer summary."""
    from safetensors.torch import save_file

    def safetensors(tensors, index):
        return lambda f: save_file(tensors, str(f), metadata={META_KEY: json.dumps(index)})

    mine = [tmp / f"adapter-{rank:05d}.safetensors"]
    _write(mine[0], safetensors(*_owned_slices([p for _, p in adapter_factors(model)], None, lambda p: p)))
    _crash_point("between_shards")
    opt_local = None
    if optimizer is not None:
        tensors, index, steps = {}, {}, {}
        owned = [p for g in groups for p in g if is_owner(p.lora_meta) and optimizer.state.get(p)]
        for p in owned:
            st = optimizer.state[p]["step"]
            steps[p.lora_meta.global_name] = {"value": float(st), "dtype": str(st.dtype).split(".")[-1]} \
                if torch.is_tensor(st) else {"value": float(st), "dtype": None}
        for kind in MOMENTS:
            t, i = _owned_slices(owned, kind, lambda p: optimizer.state[p].get(kind))
            tensors.update(t)
            index.update(i)
        mine.append(tmp / f"optim-{rank:05d}.safetensors")
        _write(mine[-1], safetensors(tensors, index))
        opt_local = {"names": [[p.lora_meta.global_name for p in g] for g in groups], "steps": steps,
                     "has_state": any(optimizer.state.get(p) for g in groups for p in g)}
    mine.append(tmp / f"state-{rank:05d}.pt")
    _write(mine[-1], lambda f: torch.save(state, f))
    return {f.name: _digest(f) for f in mine}, opt_local


def _digest(f: Path) -> dict:
    return {"bytes": f.stat().st_size, "sha256": sha256_file(f)}


def _optimizer_json(optimizer, summaries: list[dict]) -> dict:
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        groups.append({"hyper": {k: _jsonable(v) for k, v in g.items() if k != "params"},
                       "names": sorted({n for o in summaries for n in o["names"][gi]})})
    steps = {}
    for o in summaries:
        steps.update(o["steps"])
    return {"class": type(optimizer).__name__, "groups": groups, "steps": steps,
            "has_state": any(o["has_state"] for o in summaries)}


def _tidy(root: Path) -> None:
    """Rank 0, before a save: plan_cleanup's removals and restores (debris of crashed saves)."""
    pointer = root / LATEST
    entries = {p.name: (p / MANIFEST).is_file() for p in root.iterdir()}
    for act, name, *to in plan_cleanup(entries, _read_pointer(pointer) if pointer.is_file() else None):
        p = root / name
        if act == "restore":
            os.rename(p, root / to[0])
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    _fsync(root)


def _publish(root: Path, tmp: Path, final: Path, shared: dict, manifest: dict) -> None:
    """Rank 0: the shared files, manifest.json last, the next `latest`, then the renames; on any error before the
    commit everything is put back as it was (the previous checkpoint in place, no .tmp left)."""
    old, pointer = root / f"{OLD_PREFIX}{final.name}", root / LATEST_TMP
    moved = renamed = committed = False
    try:
        for name, obj in shared.items():
            _write(tmp / name, lambda f: f.write_text(json.dumps(obj, indent=1, sort_keys=True)))
            manifest["files"][name] = _digest(tmp / name)
        _crash_point("before_manifest")
        _write(tmp / MANIFEST, lambda f: f.write_text(json.dumps(manifest, indent=1, sort_keys=True)))
        _fsync(tmp)
        _write(pointer, lambda f: f.write_text(final.name + "\n"))
        _crash_point("before_rename")
        if final.exists():                              # the same step saved again (a resumed run)
            os.rename(final, old)
            moved = True
            _crash_point("mid_replace")
        os.rename(tmp, final)
        renamed = True
        _fsync(root)
        _crash_point("before_latest")
        os.replace(pointer, root / LATEST)
        committed = True
        _fsync(root)
        _crash_point("before_cleanup")
        shutil.rmtree(old, ignore_errors=True)
    except Exception:
        if not committed:
            with contextlib.suppress(OSError):
                if renamed:
                    os.rename(final, tmp)
                if moved:
                    os.rename(old, final)
            shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError):
                pointer.unlink(missing_ok=True)
        raise


def non_finite(model, optimizer) -> str | None:
    """The first of this rank's adapter factors or AdamW moments holding NaN or inf, named ("adapter factor NAME
    holds nan" / "exp_avg_sq of adapter factor NAME holds inf"); None when all are finite."""
    for _, p in adapter_factors(model):
        bad = _bad_values(p)
        if bad:
            return f"adapter factor {p.lora_meta.global_name} holds {bad}"
    if optimizer is not None:
        for g in optimizer.param_groups:
            for p in g["params"]:
                for kind in MOMENTS:
                    t = optimizer.state.get(p, {}).get(kind)
                    bad = _bad_values(t) if torch.is_tensor(t) else None
                    if bad:
                        name = getattr(getattr(p, "lora_meta", None), "global_name", "?")
                        return f"{kind} of adapter factor {name} holds {bad}"
    return None


def _bad_values(t: torch.Tensor) -> str | None:
    t = t.detach()
    if bool(torch.isfinite(t).all()):
        return None
    return " and ".join(w for w, m in (("nan", torch.isnan(t)), ("inf", torch.isinf(t))) if bool(m.any()))


def save_checkpoint(root, step: int, model, optimizer, *, run_meta: dict, state: dict) -> Path:
    """Save at `step` (all ranks call it, with their own `state`); returns ROOT/step-NNNNNNNN. `optimizer`: the
    torch AdamW over the model's adapter factors (None: adapters only). A failed write raises one OSError naming the
    file on every rank, with the previous checkpoint in place and no .tmp left. A non-finite adapter factor or
    AdamW moment on any rank is refused before anything is written: one ValueError naming it, on every rank, the
    previous checkpoint untouched (a resume must never load NaN)."""
    rank, world = _rank_world()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    bad = [b for b in _gather(non_finite(model, optimizer)) if b]
    if bad:
        raise ValueError(f"save_checkpoint step {step}: {bad[0]}: not saved, the previous checkpoint stays")
    groups = _optimizer_params(optimizer) if optimizer is not None else None
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _tidy(root)
            tmp.mkdir()
        except Exception as e:
            error = _write_error(tmp, e)
    _raise_shared(_gather(error))

    error, digests, opt_local = None, {}, None
    try:
        _crash_point("before_shards")
        digests, opt_local = _write_rank_files(tmp, rank, model, optimizer, groups, state)
        _crash_point("after_shards")
    except Exception as e:
        error = _write_error(tmp, e)
    everything = _gather((error, digests, opt_local))
    if any(e for e, _, _ in everything):               # every rank has finished writing: tidy, then all raise
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_shared([e for e, _, _ in everything])

    error = None
    if rank == 0:
        shared = {"lora_config.json": model.lora_config.to_dict()}
        if optimizer is not None:
            shared[OPTIMIZER_FILE] = _optimizer_json(optimizer, [o for _, _, o in everything])
        files = {}
        for _, d, _ in everything:
            files.update(d)
        manifest = {"format": FORMAT, "step": step, "world_size": world, "run_meta": run_meta,
                    "lora_config": model.lora_config.to_dict(), "optimizer": optimizer is not None, "files": files}
        try:
            _publish(root, tmp, final, shared, manifest)
        except Exception as e:
            error = _write_error(final, e)
    _raise_shared(_gather(error))
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


