"""Reading a checkpoint (all ranks): the candidates in order (latest, then older complete ones), each verified
before anything is copied, the same choice on every rank (checkpoint/api.py describes the format)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..lora.config import LoRAConfig
from ..lora.layers import adapter_factors
from ..lora.state import META_KEY
from .attempts import FAILED, failed_steps
from .common import (MOMENTS, OPTIMIZER_FILE, _gather, _line, _local_slice, _optimizer_params, _rank_world,
                     _read_pointer)
from .directory import (FORMAT, LATEST, MANIFEST, OLD_PREFIX, IntegrityError, check_file, plan_candidates,
                        step_dir_name, step_of)
from .reshard_plan import Piece, check_run_meta, plan_reads





# ---- load -------------------------------------------------------------------------------------------------------



def _candidates(root: Path) -> list[str]:
    """plan_candidates over ROOT as it is now ([] without a `latest` pointer), less the steps a restart failed on
    (attempts.py)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return []
    complete = {p.name for p in root.iterdir() if (p / MANIFEST).is_file()}
    failed = set(failed_steps(root))
    return [n for n in plan_candidates(_read_pointer(pointer), complete)
            if step_of(n.removeprefix(OLD_PREFIX)) not in failed]


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


def _first_readable(root: Path) -> tuple[Path, dict] | None:
    for name in _candidates(root):
        try:
            ckpt = _find(root, name)
            m = _read_manifest(ckpt)
            m["step"]
            return ckpt, m
        except (IntegrityError, KeyError):
            continue
    return None


def resumable_step(root) -> int | None:
    """The step load_checkpoint(ROOT, ...) would load, judged by the manifests alone (no hashing: cheap, one process,
    no collective); None when ROOT holds no checkpoint. Should a file then fail its checksum, the load falls back
    further (or refuses when nothing verifies)."""
    found = _first_readable(Path(root))
    return None if found is None else found[1]["step"]


def check_resume_lora(root, lora_config: LoRAConfig) -> None:
    """The LoRA refusal load_checkpoint(ROOT, ...) gives adapters built with LORA_CONFIG (rank, alpha, adapter
    layout, targets: LoRAConfig.check_compatible), from the manifest resumable_step reads: a one-line ValueError
    in a second, before any model is built. The load would refuse that same manifest (refusals come before any
    hashing and are never a fallback), possibly naming a run_meta difference first. No checkpoint, or a manifest
    without a LoRA config: nothing checked here."""
    found = _first_readable(Path(root))
    if found is not None and isinstance(found[1].get("lora_config"), dict):
        lora_config.check_compatible(LoRAConfig.from_dict(found[1]["lora_config"]), str(found[0]))


def _pieces(ckpt: Path, files: list[str]) -> dict[tuple[str, str], list[Piece]]:
    """(kind, global name) -> stored slices; kind "param" for adapters, else the moment's name."""
    from safetensors import safe_open

    out: dict[tuple[str, str], list[Piece]] = {}
    for name in files:
        with safe_open(str(ckpt / name), "pt") as s:
            index = json.loads((s.metadata() or {}).get(META_KEY, "{}"))
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
    for what, t, name in ([("adapter factor", t, p.lora_meta.global_name) for p, t in params] +
                          [(f"{k} of adapter factor", v, p.lora_meta.global_name) for p, st in opt_states
                           for k, v in st.items() if k in MOMENTS]):
        if not bool(torch.isfinite(t).all()):
            kind = "nan" if bool(torch.isnan(t).any()) else "inf"
            raise IntegrityError(f"{ckpt}: step {m['step']}: {what} {name} holds {kind}: not loaded")
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
    verifies: IntegrityError. A checkpoint holding a non-finite adapter factor or AdamW moment does not verify
    (IntegrityError naming the tensor and the step), so the newest finite one loads instead. Steps a restart failed
    on (checkpoint/attempts.py) are never candidates. Refusals are one-line ValueErrors; either is raised on every
    rank, nothing changed."""
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
        failed = failed_steps(root) if step is None and (root / LATEST).is_file() else []
        if failed:
            raise ValueError(f"{root}: no checkpoint left to resume from: a restart failed on step(s) "
                             f"{', '.join(map(str, failed))} (recorded in {root / FAILED}; never loaded again)")
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

