"""The main job: GRPO with expert LoRA, Router Replay (R3) and LoRA-only refit to a vLLM engine.

    moe-lora-rl train --nproc-per-node 2 [--config-name NAME] [key=value ...]      # launch.py: checks, then this
    torchrun --standalone --nproc_per_node=2 -m moe_lora_rl.train [--config-name NAME] [key=value ...]

Configuration: recipes/train.yaml, or recipes/NAME.yaml with --config-name NAME (long: the long-reasoning job)
(hydra, strict keys; schema and help in moe_lora_rl/rl/config/), e.g.
layout.tp=2 layout.ep=2 lora.rank=16 replay=r2 serving=merged algo.lr=0 steps=10. A bad key or value, a layout
that does not fit the world size or the model, or a data file that does not parse is a one-line error before any
process group or engine starts. The console shows our lines, the progress bar and real errors; dependencies'
warnings that say nothing to the user go to out_dir/warnings-rank*.log only (rl/console.py).
"""
from __future__ import annotations

import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from .rl.console import log_warnings_to, quiet_progress, route_warnings

    route_warnings()                  # dependencies' noise to out_dir's log only (rl/console.py)
    quiet_progress()
    from .rl import config
    from .rl.config import preflight

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        name, overrides = config.split_config_name(sys.argv[1:] if argv is None else argv)
        cfg = config.load(overrides, config_name=name)
        if cfg.runtime.device == "cpu":
            # megatron-core's fused kernels go through torch.compile, which costs tens of seconds per first call on
            # CPU for nothing; set before torch's compiler is first imported (a caller's explicit value wins)
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
        preflight.check(cfg, world)
    except ValueError as e:
        print(f"train: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    from pathlib import Path

    log_warnings_to(Path(cfg.out_dir) / f"warnings-rank{os.environ.get('RANK', '0')}.log")
    from .rl.modes import run_class

    try:
        summary = run_class(cfg)(cfg, world).run()
    except ValueError as e:           # a refused checkpoint or input found once the run started: every rank has it
        if os.environ.get("RANK", "0") == "0":
            print(f"train: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({k: v for k, v in summary.items() if k != "evals"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
