"""torchrun worker (2 ranks) of tests/distributed/test_rank0_wait.py: the main job's set-up (rl/run.py
GRPORun.setup) with rank 0's model (model_dir: the warm start) replaced by a stand-in that takes --slow-s seconds,
and the process group's timeout (run_config.PG_TIMEOUT) shortened to --pg-timeout-s, shorter than that. Set-up stops
where the model's path is first used (the tokenizer), reporting the path each rank received. Two cases, each rank's
outcome kept even where a rank fails:

    slow     rank 0 is --slow-s seconds building its model; every rank must get its path
    failed   rank 0's model fails (ValueError); rank 0 raises it, the others one line naming it

Every rank writes rank{r}.json beside --result; rank 0 gathers them into --result (no process group: it may be the
thing that failed).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

FAKE_PATH = "/nonexistent/warm-started-by-rank-0"


class Reached(Exception):
    """Set-up reached the tokenizer with this path."""


def _outcome(fn) -> dict:
    try:
        fn()
    except Reached as r:
        return {"reached": str(r)}
    except Exception as e:  # noqa: BLE001 - the test reads every rank's failure
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": "none", "message": "set-up returned without using the model's path"}


def _wait_start(folder: Path, rank: int, world: int) -> None:
    """Both ranks start set-up within ~0.1 s of each other (their imports may differ by seconds on a loaded
    machine, longer than the shortened process-group timeout)."""
    (folder / f"ready{rank}").touch()
    while not all((folder / f"ready{r}").exists() for r in range(world)):
        time.sleep(0.05)


def main(argv=None) -> None:
    import argparse

    import torch.distributed as dist
    import transformers

    from moe_lora_rl.megatron import run_config
    from moe_lora_rl.rl import config, run

    ap = argparse.ArgumentParser()
    ap.add_argument("--slow-s", type=float, required=True)
    ap.add_argument("--pg-timeout-s", type=float, required=True)
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    folder = Path(a.result).parent
    run_config.PG_TIMEOUT = datetime.timedelta(seconds=a.pg_timeout_s)

    def tokenizer(path, *args, **kwargs):
        raise Reached(str(path))

    transformers.AutoTokenizer.from_pretrained = tokenizer
    cfg = config.load(["layout.tp=1", "layout.ep=1", "layout.pp=1"])
    out = {}

    def slow(cfg):
        time.sleep(a.slow_s)
        return Path(FAKE_PATH), {"warmup_s": a.slow_s, "warmup_cached": False, "warm_start": True}

    def failed(cfg):
        raise ValueError("warm start diverged: loss nan at step 3")

    _wait_start(folder, rank, world)
    for case, model_dir in (("slow", slow), ("failed", failed)):
        run.model_dir = model_dir
        t0 = time.time()
        out[case] = {**_outcome(lambda: run.GRPORun(cfg, world).setup()), "s": round(time.time() - t0, 1)}
        if "reached" not in out[case] and case == "slow":
            break                                    # the process group is not usable: the other case cannot run
    (folder / f"rank{rank}.json").write_text(json.dumps(out))
    if rank == 0:
        deadline = time.time() + 300
        while not all((folder / f"rank{r}.json").exists() for r in range(world)) and time.time() < deadline:
            time.sleep(0.1)
        ranks = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)
                 if (folder / f"rank{r}.json").exists()}
        Path(a.result).write_text(json.dumps({"ranks": ranks, "fake_path": FAKE_PATH}))
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group left broken by the slow case on today's code
            pass
    sys.stdout.flush()
    os._exit(0)                                      # a broken gloo group may hang in its destructor


if __name__ == "__main__":
    main()
