"""Whole-job runs a bench keeps in --out DIR, one folder a run, so that a set of runs hours long outlives a session
(bench sparse, bench r3_ab): each folder records the job's overrides (bench_overrides.json) before the job starts;
with --reuse a finished run (summary.json) is read back, an unfinished one is run again (with `checkpoint_every` and
`resume=auto` among its overrides it continues from its last checkpoint), and a folder made under other overrides is
refused, naming them, before any run starts.

    kept(out, overrides, reuse, run) -> (summary, "reused" | "resumed" | "ran")
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

OVERRIDES = "bench_overrides.json"
"""Each run's folder: the job's overrides, as the bench ran it; --reuse reads or continues a run only under the
same ones."""
RESUMABLE = ("checkpoint_every=10", "resume=auto")
"""Overrides that make a kept run continuable: a checkpoint every 10 steps (the evaluations' interval), and the job
resuming from the latest one when run again in its folder (rl/run.py)."""


def with_warm_start(setting: list[str], warm: list[str], extra: list[str], model_over: list[str]) -> list[str]:
    """A setting's overrides (before the user's, which win) with its warm start `warm` unless --model (model_over)
    or a model.warm_* override among `extra` chooses the model."""
    chosen = model_over or any(o.lstrip("+").startswith("model.warm") for o in extra)
    return [*setting, *([] if chosen else warm)]


def mismatch(out: Path, overrides: list[str]) -> None:
    """ValueError naming the first difference where --reuse would read or continue the run in `out` (finished:
    summary.json; begun: bench_overrides.json) made with other overrides than this call's, or a finished run whose
    overrides were not recorded."""
    recorded = (out / OVERRIDES).is_file()
    if not recorded and not (out / "summary.json").is_file():
        return
    if not recorded:
        raise ValueError(f"--reuse: {out} has no {OVERRIDES}: its settings are unknown; move it away to run it again")
    was = json.loads((out / OVERRIDES).read_text())
    if was != overrides:
        diff = sorted(set(was) ^ set(overrides)) or ["their order"]
        raise ValueError(f"--reuse: {out} was run with other overrides ({', '.join(diff)} differ); give the same "
                         "arguments or another --out")


def fresh(out: Path) -> None:
    """Without --reuse, a resumable run must start fresh: ValueError if `out` holds an earlier run's checkpoints
    (resume=auto would continue that run, whatever its settings)."""
    if (out / "checkpoints").is_dir():
        raise ValueError(f"{out} holds an earlier run's checkpoints: --reuse continues it (under the same "
                         "arguments), or move it away, or give another --out")


def kept(out: Path, overrides: list[str], reuse: bool, run: Callable[[list[str]], dict]) -> tuple[dict, str]:
    """The run in `out`: read back (reuse and finished), or `run(overrides)` after recording them ("resumed" where
    reuse finds its checkpoints); call mismatch() (reuse) or fresh() on every folder first, before any run starts."""
    if reuse and (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text()), "reused"
    how = "resumed" if reuse and (out / "checkpoints").is_dir() else "ran"
    out.mkdir(parents=True, exist_ok=True)
    (out / OVERRIDES).write_text(json.dumps(overrides))
    return run(overrides), how
