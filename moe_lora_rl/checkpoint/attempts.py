"""Which checkpoints a restart failed on (rank 0, plain files under ROOT; no collective), so a resume never loads
one again: torchrun's --max-restarts ends on one line instead of resuming into the same failure each time.

    after a resume loaded step N:          mark_resuming(root, N)     ROOT/.resuming holds "N"
    after the resumed run's first step:    resume_succeeded(root)     ROOT/.resuming removed
    at the next start, before choosing:    record_failed_resume(root) .resuming still there: the restart failed on
                                                                      step N -> N added to ROOT/failed_resumes.json
    load_checkpoint and resumable_step skip every step failed_steps(root) lists.

A resume that failed for a reason of its own (an engine that did not start) also marks its checkpoint: the next
start resumes from the one before it, which repeats some steps but never loads the same checkpoint twice.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

RESUMING = ".resuming"
FAILED = "failed_resumes.json"


def failed_steps(root) -> list[int]:
    """The steps a restart failed on, oldest record first ([] when none)."""
    f = Path(root) / FAILED
    if not f.is_file():
        return []
    try:
        steps = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: unreadable ({e}); remove it to load every checkpoint again") from None
    if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ValueError(f"{f}: expected a JSON list of step numbers, got {steps!r}")
    return steps


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def mark_resuming(root, step: int) -> None:
    """A resume just loaded `step`: until resume_succeeded, a restart counts it as failed."""
    _write(Path(root) / RESUMING, f"{int(step)}\n")


def resume_succeeded(root) -> None:
    (Path(root) / RESUMING).unlink(missing_ok=True)


def record_failed_resume(root) -> int | None:
    """At a start: a .resuming left by the previous start means that start failed on its checkpoint; its step is
    added to failed_resumes.json and returned (None: nothing to record)."""
    root = Path(root)
    f = root / RESUMING
    if not f.is_file():
        return None
    try:
        step = int(f.read_text().strip())
    except ValueError:
        f.unlink()
        return None
    steps = failed_steps(root)
    if step not in steps:
        _write(root / FAILED, json.dumps(steps + [step]) + "\n")
    f.unlink()
    return step
