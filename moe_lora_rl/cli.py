"""The `moe-lora-rl` console script: `moe-lora-rl plan ...` (the layout planner, plan/cli.py) and
`moe-lora-rl train ...` (the main job's launcher, launch.py)."""
from __future__ import annotations

import sys

USAGE = "usage: moe-lora-rl {plan,train} [options]  (moe-lora-rl plan --help, moe-lora-rl train --help)"


def console(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        from .plan.cli import main

        return main(argv[1:])
    if argv[:1] == ["train"]:
        from .launch import main

        return main(argv[1:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(console())
