"""`moe-lora-rl train`: the main job's launcher. Everything a user can get wrong is checked in this process before
any rank starts, then torch's elastic launcher starts the ranks in-process (what torchrun does):

    moe-lora-rl train [--nproc-per-node N] [--config-name NAME] [key=value ...]

    1. the configuration (strict keys, every value; rl/config/)
    2. the layout, the model and its tokenizer (rl/config/preflight.py)
    3. the data files, the prompts' lengths (data.max_prompt_length, data.truncation, filtering: the first
       preflight.MEASURED_ROWS of a split) and the answers' (algo.max_response_tokens), in the same tokenizer load
    4. the reward: its file or module imports, the function takes verl's arguments, and one call per data_source
       returns a finite number (verl's default scorer raises NotImplementedError for a source it does not know)
    5. torch.distributed.run with --standalone, running `-m moe_lora_rl.train` on every rank

A user error is one line on stderr and exit status 2, from this process or from a rank (whose own line is the only
output: the launcher adds no traceback). `torchrun --standalone --nproc_per_node=N -m moe_lora_rl.train ...` keeps
working (each rank runs the checks of steps 1-3 itself, measuring the prompts as it reaches them).
"""
from __future__ import annotations

import os
import sys

PROG = "moe-lora-rl train"
USAGE = f"usage: {PROG} [--nproc-per-node N] [--config-name NAME] [key=value ...]"


def parse(argv: list[str]) -> tuple[int, list[str]]:
    """(ranks, the arguments for moe_lora_rl.train); ValueError naming a bad flag."""
    nproc, rest, args = 2, [], list(argv)
    while args:
        a = args.pop(0)
        if a in ("--nproc-per-node", "--nproc_per_node") or a.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            v = a.split("=", 1)[1] if "=" in a else (args.pop(0) if args else "")
            if not v.isdigit() or int(v) < 1:
                raise ValueError(f"--nproc-per-node={v!r}: a number of ranks >= 1")
            nproc = int(v)
        elif a in ("-h", "--help"):
            raise SystemExit(print(__doc__.split("\n\n")[1], file=sys.stderr) or 0)
        elif a.startswith("-") and not a.startswith(("--config-name", "-cn")):
            raise ValueError(f"unknown option {a!r} ({USAGE})")
        else:
            rest.append(a)
    return nproc, rest


def check(train_args: list[str], world: int):
    """Steps 1-4 above; the config. ValueError (one line) on the first thing wrong."""
    from .rl import config
    from .rl.config import preflight

    name, overrides = config.split_config_name(train_args)
    cfg = config.load(overrides, config_name=name)
    preflight.check(cfg, world, prompt_rows=preflight.MEASURED_ROWS)
    check_reward(cfg)
    return cfg


def check_reward(cfg) -> None:
    from .data.dataset import examples_from_rows, load_examples, task_rows
    from .data.rewards import RewardWorkers, load_function

    r, d = cfg.reward, cfg.data
    if r.path is not None:
        load_function(r.path, r.name)          # its import and signature, here, in one line
    examples = []
    for split, task_split in (("train", "train"), ("val", "eval")):
        files = d.files(split)
        examples += load_examples(files, d.prompt_key) if files else examples_from_rows(
            task_rows(d.task_spec(), task_split)[:1])
    workers = RewardWorkers(r.path, r.name, r.timeout_s)
    try:
        workers.probe(examples)
    finally:
        workers.close(kill=True)


def start(nproc: int, train_args: list[str]) -> int:
    """The ranks, under torch's elastic launcher in this process; the first failed rank's exit status."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)      # a rank's own line says what went wrong
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "moe_lora_rl.train", *train_args]))
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c == 2), codes[0] if codes and codes[0] > 0 else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .rl.console import quiet_progress, route_warnings

    route_warnings()
    quiet_progress()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        nproc, train_args = parse(argv)
        cfg = check(train_args, nproc)
    except ValueError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if cfg.runtime.device == "cpu":
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    try:
        return start(nproc, train_args)
    except KeyboardInterrupt:
        return 130
