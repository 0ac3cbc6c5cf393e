"""What the checkpoint writer and reader share: the process-group helpers, the crash points, write errors shared
by every rank, the optimizer's adapter factors and a rank's slice of one."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..lora.state import group_rank_size, slice_bounds
from .directory import CRASH_ENV, LATEST, crash_action, step_of

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
OPTIMIZER_FILE = "optimizer.json"
CRASH_EXIT = 87                                   # the exit status of an injected kill





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
    return slice_bounds(meta, size, rank)


def _read_pointer(pointer: Path) -> str:
    try:
        return pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return f"<unreadable: {_line(e)}>"


def latest_step(root) -> int | None:
    """The step `latest` names, or None when ROOT has no checkpoint (whether that one loads: resumable_step)."""
    p = Path(root) / LATEST
    return step_of(_read_pointer(p)) if p.is_file() else None
