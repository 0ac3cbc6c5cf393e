"""The main job as the benches of whole jobs run it (e2e, long, async, r3_ab, sparse, policies): their common
arguments, the job under torchrun with its summary read back, a dataset's overrides, the job's own checks before
anything starts, and figures read from a run's summary.

    ap = job_parser(name, __doc__, "both runs"); argv, extra = split_overrides(argv)
    lay, layout_over, model_over = job_layout(ap.parse_args(argv), name)
    check_job(overrides, nproc); summary = run_job(nproc, overrides, out_dir, timeout)
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from ...checks.torchrun import worker_env
from ...checks.train_runs import train_command
from ...megatron.layout import parse_layouts


def run_job(nproc: int, overrides: list[str], out_dir: Path, timeout: float, prefix=()) -> dict:
    """The job's summary; prefix: a command to run torchrun under (e.g. taskset -c 0)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "driver.log"
    with open(log, "w") as f:
        proc = subprocess.run([*prefix, *train_command(out_dir, overrides, nproc)], env=worker_env(),
                              stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    summary = out_dir / "summary.json"
    if proc.returncode != 0 or not summary.exists():
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"moe_lora_rl.train exited with {proc.returncode}; log {log}:\n{tail}")
    return json.loads(summary.read_text())


def job_parser(name: str, doc: str, runs: str) -> argparse.ArgumentParser:
    """The arguments every bench of whole jobs takes (--json, --model, --layouts, --out, --timeout); `runs` names
    the runs in the help."""
    ap = argparse.ArgumentParser(prog=f"python -m moe_lora_rl.bench {name}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in warm-started model)")
    ap.add_argument("--layouts", default="tp1ep1pp1", help=f"the one layout of {runs}")
    ap.add_argument("--out", default=None, help=f"keep {runs}' outputs here (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    return ap


def split_overrides(argv) -> tuple[list[str], list[str]]:
    """(the bench's own arguments, the hydra overrides after `--`)."""
    argv = list(argv or [])
    return (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def job_layout(a: argparse.Namespace, name: str) -> tuple[object, list[str], list[str]]:
    """The one layout of job_parser's --layouts, its overrides and the --model override; ValueError naming a bad
    value."""
    layouts = parse_layouts(a.layouts)
    if len(layouts) != 1:
        raise ValueError(f"--layouts={a.layouts!r}: {name} runs one layout, got {len(layouts)}")
    if a.model is not None and not (Path(a.model) / "config.json").is_file():
        raise ValueError(f"--model={a.model!r} is not an HF checkpoint directory")
    lay = layouts[0]
    return (lay, [f"layout.tp={lay.tp}", f"layout.ep={lay.ep}", f"layout.etp={lay.etp}", f"layout.pp={lay.pp}"],
            [f"model.path={a.model}"] if a.model else [])


def data_overrides(name: str, where: Path) -> list[str]:
    """A dataset's files (written to `where`), its reference column and its job settings, as overrides."""
    from ...data import JOB_OVERRIDES, REFERENCE_KEYS, write

    paths = write(name, where)
    ref = REFERENCE_KEYS.get(name)
    return [f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
            *([f"data.reference_key={ref}"] if ref else []), *JOB_OVERRIDES.get(name, [])]


def check_job(overrides: list[str], nproc: int):
    """The job's own checks, here, so a bad value is refused before anything starts (a --config-name among the
    overrides picks the recipe, as the driver does); returns the job's config."""
    from ...rl import config
    from ...rl.config import preflight

    name, rest = config.split_config_name(overrides)
    cfg = config.load(rest, config_name=name)
    preflight.check(cfg, nproc)
    return cfg


def ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected comma-separated integers") from None
    if not out:
        raise ValueError(f"{what}={text!r}: expected at least one value")
    return out


def rate(s: dict) -> float:
    return s["steps"] * 60.0 / (s["wall_s"] - s["eval_s"])


def phases(s: dict) -> tuple[float, float]:
    """(rollout, train) seconds per step of a synchronous run, evaluation left out."""
    return ((s["rollout_busy_frac"] * s["wall_s"] - s["eval_s"]) / s["steps"],
            s["train_busy_frac"] * s["wall_s"] / s["steps"])
