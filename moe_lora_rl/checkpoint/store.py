"""Training checkpoints of a LoRA policy: sharded adapters, their AdamW state sharded the same way, and the caller's
run state (step, adapter version, data position, RNG states, scheduler), loadable at any other layout.

    save:  rank 0 tidies debris -> all ranks write into ROOT/.tmp-step-N/ and hash their files -> exchange success
           -> rank 0 writes manifest.json last and .latest.tmp -> (same step again: step-N -> .old-step-N) ->
           .tmp-step-N -> step-N -> .latest.tmp -> latest (the commit) -> .old-step-N removed -> share the verdict
    load:  latest -> manifest -> run identity and LoRA config -> sha256 of every file -> plan the reads of this
           rank's slices (ckpt_plan.plan_reads) -> only when every rank found everything: copy into the model and
           the optimizer; an integrity error (missing, incomplete, corrupted) tries the next candidate

Crash consistency: a kill anywhere in a save leaves the previous complete checkpoint as the one loaded, until the
commit (new step: `latest` replaced; same step again: .tmp-step-N renamed to step-N). The load ignores .tmp-*, step
directories without manifest and newer steps than `latest` names; when that one is missing, incomplete or fails a
checksum it loads .old-step-N (a resave killed between its renames) or the newest older complete checkpoint, with one
line on stderr (rank 0), every rank choosing the same. Run identity and LoRA config mismatches are refusals, never a
fallback. The next save removes the debris (plan_cleanup) and puts an interrupted resave's old copy back. A write
error (disk full) is one OSError naming the file, raised on every rank together, with the .tmp removed.

Crash points (tests): MOE_LORA_RL_CKPT_CRASH=POINT[:exit|:raise][:rankR], read at each point; exit = os._exit(CRASH_EXIT)
(a kill), raise = RuntimeError (a write failure: shared and rolled back like one); rankR: on that global rank only.
    before_shards    .tmp-step-N made, nothing written
    between_shards   this rank's adapter file written, its optimizer file not
    after_shards     this rank's files written and hashed, before the ranks exchange success
    before_manifest  rank 0: lora_config.json and optimizer.json written, manifest.json not
    before_rename    rank 0: manifest.json and .latest.tmp written, nothing renamed
    mid_replace      rank 0, same step again only: step-N moved to .old-step-N, .tmp-step-N not yet renamed
    before_latest    rank 0: step-N in place, `latest` not replaced (a resave has committed here)
    before_cleanup   rank 0: `latest` replaced (committed), .old-step-N not yet removed

A refusal (a one-line ValueError naming the file and the mismatch, the same on every rank) changes neither the model,
the optimizer nor any file. Adam's moments have their parameter's shape and sharding, so they are stored as slices of
the global canonical tensor exactly like the adapters (lora/state.py's format: the step directory also loads with
lora.load_sharded).

Exact resume, in this order:
    meta = describe_run(model_path, lora, layout, seed=cfg.seed, algo=...)   # what must not change across a resume
    after step k (update, push, metrics logged): save_checkpoint(root, k, model, optimizer, run_meta=meta,
        state={"step": k, "version": policy.version, "rng": rng_state(), ...})
    on resume (resumable_step(root) is not None), after building the model and optimizer, before the first push:
        state = load_checkpoint(root, model, optimizer, run_meta=meta); set_rng_state(state["rng"])
        policy.version = state["version"]; (re)start the engine; push that version; continue with step k + 1
"""
from __future__ import annotations

import json
import os
import contextlib
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..lora.config import LoRAConfig
from ..lora.layers import adapter_factors
from ..lora.state import _META_KEY, _slice_bounds, group_rank_size, is_owner
from .plan import (CRASH_ENV, FORMAT, LATEST, LATEST_TMP, MANIFEST, OLD_PREFIX, TMP_PREFIX, IntegrityError, Piece,
                   check_file, check_run_meta, crash_action, plan_candidates, plan_cleanup, plan_reads, sha256_file,
                   step_dir_name, step_of)

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
OPTIMIZER_FILE = "optimizer.json"
CRASH_EXIT = 87                                   # the exit status of an injected kill


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


def _crash_point(point: str) -> None:
    """The test hook at each point of CRASH_POINTS: a kill (os._exit) or a RuntimeError when CRASH_ENV names the point
    on this rank (read at every call, never at import); nothing otherwise."""
    mode = crash_action(os.environ.get(CRASH_ENV), point, _rank_world()[0])
    if mode == "exit":
        os._exit(CRASH_EXIT)
    if mode == "raise":
        raise RuntimeError(f"injected crash at {point}")


def _line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class _WriteFailed(Exception):
    """(class name, one-line message naming the file): a write that failed on this rank, to be shared."""


def _write_error(path: Path, e: BaseException) -> tuple[str, str]:
    if isinstance(e, _WriteFailed):
        return e.args
    if isinstance(e, OSError):
        return "OSError", f"checkpoint: cannot write {path}: {_line(e)}"
    return "RuntimeError", f"checkpoint: cannot write {path}: {type(e).__name__}: {_line(e)}"


def _write(path: Path, write) -> None:
    """write(path), then fsync it; any failure becomes _WriteFailed naming PATH."""
    try:
        write(path)
        _fsync(path)
    except Exception as e:
        raise _WriteFailed(*_write_error(path, e)) from e


def _raise_shared(errors: list) -> None:
    """Every rank raises the first write error any rank had (all ranks call it after the same collective, so none
    is left waiting in a later one for a rank that failed)."""
    errors = [e for e in errors if e]
    if errors:
        kind, msg = errors[0]
        raise (OSError if kind == "OSError" else RuntimeError)(msg)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        return lambda f: save_file(tensors, str(f), metadata={_META_KEY: json.dumps(index)})

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


def save_checkpoint(root, step: int, model, optimizer, *, run_meta: dict, state: dict) -> Path:
    """Save at `step` (all ranks call it, with their own `state`); returns ROOT/step-NNNNNNNN. `optimizer`: the
    torch AdamW over the model's adapter factors (None: adapters only). A failed write raises one OSError naming the
    file on every rank, with the previous checkpoint in place and no .tmp left."""
    rank, world = _rank_world()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
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


# ---- load -------------------------------------------------------------------------------------------------------

def _read_pointer(pointer: Path) -> str:
    try:
        return pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return f"<unreadable: {_line(e)}>"


def latest_step(root) -> int | None:
    """The step `latest` names, or None when ROOT has no checkpoint (whether that one loads: resumable_step)."""
    p = Path(root) / LATEST
    return step_of(_read_pointer(p)) if p.is_file() else None


def _candidates(root: Path) -> list[str]:
    """plan_candidates over ROOT as it is now ([] without a `latest` pointer)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return []
    complete = {p.name for p in root.iterdir() if (p / MANIFEST).is_file()}
    return plan_candidates(_read_pointer(pointer), complete)


def _find(root: Path, name: str) -> Path:
    if step_of(name.removeprefix(OLD_PREFIX)) is None:
        raise IntegrityError(f"{root / LATEST}: names {name!r}, not a step-NNNNNNNN directory")
    ckpt = root / name
    if not ckpt.is_dir():
        raise IntegrityError(f"{ckpt}: no such checkpoint directory")
    return ckpt


def _read_manifest(ckpt: Path) -> dict:
    f = ckpt / MANIFEST
    if not f.is_file():
        raise IntegrityError(f"{f}: missing, the checkpoint is incomplete")
    try:
        m = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{f}: unreadable ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise IntegrityError(f"{f}: format {m.get('format') if isinstance(m, dict) else None!r}, expected "
                             f"{FORMAT!r}")
    return m


def resumable_step(root) -> int | None:
    """The step load_checkpoint(ROOT, ...) would load, judged by the manifests alone (no hashing: cheap, one process,
    no collective); None when ROOT holds no checkpoint. Should a file then fail its checksum, the load falls back
    further (or refuses when nothing verifies)."""
    root = Path(root)
    for name in _candidates(root):
        try:
            return _read_manifest(_find(root, name))["step"]
        except (IntegrityError, KeyError):
            continue
    return None


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


def _stage(ckpt: Path, model, optimizer, run_meta: dict) -> tuple[list, list, list, dict]:
    """Everything to copy, checked; raises IntegrityError (the checkpoint is damaged) or ValueError (a refusal)
    before anything is changed."""
    rank, world = _rank_world()
    m = _read_manifest(ckpt)
    check_run_meta(m["run_meta"], run_meta, str(ckpt))
    model.lora_config.check_compatible(LoRAConfig.from_dict(m["lora_config"]), str(ckpt))
    names = sorted(m["files"])
    for i, name in enumerate(names):                   # hashing split over the ranks; load_checkpoint shares the verdicts
        if i % world == rank:
            check_file(ckpt, name, m["files"][name])
    mine = f"state-{rank if rank < m['world_size'] else 0:05d}.pt"
    if mine not in m["files"]:
        raise IntegrityError(f"{ckpt / mine}: not listed in {ckpt / MANIFEST}")
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


def _verdict(root: Path, name: str, model, optimizer, run_meta: dict):
    """(staged, None) or (None, ("integrity" | "refusal", one-line message)) for one candidate on this rank."""
    ckpt = root / name
    try:
        return _stage(_find(root, name), model, optimizer, run_meta), None
    except IntegrityError as e:
        return None, ("integrity", _line(e))
    except ValueError as e:
        return None, ("refusal", _line(e))
    except Exception as e:                               # unreadable in some other way: damaged, try the next
        return None, ("integrity", f"{ckpt}: {type(e).__name__}: {_line(e)}")


@torch.no_grad()
def load_checkpoint(root, model, optimizer, *, run_meta: dict, step: int | None = None) -> dict:
    """Load ROOT/latest (or step-`step`) into the model's adapters and the optimizer (None: adapters only), at any
    layout; returns this rank's saved `state` (at another world size, ranks beyond the saved world get rank 0's).
    All ranks call it. When the checkpoint `latest` names is missing, incomplete or corrupted, the newest older one
    that verifies loads instead (plan_candidates; one line on stderr; never for an explicit `step`); nothing
    verifies: IntegrityError. Refusals are one-line ValueErrors; either is raised on every rank, nothing changed."""
    root = Path(root)
    rank, _ = _rank_world()
    if step is not None:
        names = [step_dir_name(step)]
    else:                                            # rank 0's list for all (a failure too: no rank left waiting)
        try:
            names = _candidates(root) if rank == 0 else None
        except OSError as e:
            names = f"{root}: cannot list the checkpoints: {_line(e)}"
        names = _gather(names)[0]
        if isinstance(names, str):
            raise IntegrityError(names)
    if not names:
        raise ValueError(f"{root / LATEST}: no checkpoint to resume from (no '{LATEST}' file in {root})")
    first = None
    for name in names:
        staged, verdict = _verdict(root, name, model, optimizer, run_meta)
        verdicts = [v for v in _gather(verdict) if v]  # every rank reaches this, so all choose the same
        refusal = next((msg for kind, msg in verdicts if kind == "refusal"), None)
        if refusal:
            raise ValueError(refusal)
        if not verdicts:
            break
        first = first or verdicts[0][1]
    else:
        raise IntegrityError(first)
    if first and rank == 0:
        print(f"checkpoint: {first}; loading {name} instead", file=sys.stderr, flush=True)
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
