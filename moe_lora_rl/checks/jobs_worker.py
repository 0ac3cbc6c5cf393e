"""Several torchrun workers in one launch (torchrun.run_torchrun_jobs): each job's main(argv) in turn, in the same ranks
and process group, so the ranks import torch, megatron-core and verl and meet once instead of once per worker.

    --jobs '[[module, [its arguments, --result FILE]], ...]'

Between jobs: megatron-core's parallel state and R3's replay instances are torn down (as each layout's end does), and
the process group is kept until the last job's finish_worker. A job that raises ends the launch, as it would alone.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path

from . import torchrun


def main(argv=None) -> None:
    from ..megatron.parallel import teardown

    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True, help="JSON list of [worker module, its argv]")
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    jobs = json.loads(a.jobs)
    for i, (module, args) in enumerate(jobs):
        torchrun.KEEP_GROUP = i < len(jobs) - 1
        teardown()
        importlib.import_module(module).main(args)
    if os.environ.get("RANK", "0") == "0":
        Path(a.result).write_text(json.dumps({"jobs": len(jobs)}))


if __name__ == "__main__":
    main()
