"""python -m moe_lora_rl.bench NAME [--json] [--model DIR] [--layouts ...]: one JSON line per run."""
from __future__ import annotations

import importlib
import sys

BENCHES = {
    "parity": "moe_lora_rl.bench.parity",
    "lora": "moe_lora_rl.bench.lora",
    "refit": "moe_lora_rl.bench.refit",
    "replay": "moe_lora_rl.bench.replay",
    "plan": "moe_lora_rl.bench.plan",
    "grpo_hf": "moe_lora_rl.bench.grpo_hf",
    "serve": "moe_lora_rl.bench.serve",
    "e2e": "moe_lora_rl.bench.e2e",
    "rollout": "moe_lora_rl.bench.rollout",
    "verl": "moe_lora_rl.bench.verl",
    "verl_user": "moe_lora_rl.bench.verl_user",
    "async": "moe_lora_rl.bench.async_rl",
    "r3_ab": "moe_lora_rl.bench.r3_ab",
    "sparse": "moe_lora_rl.bench.sparse",
    "long": "moe_lora_rl.bench.long",
    "peers": "moe_lora_rl.bench.peers",
    "policies": "moe_lora_rl.bench.policies",
    "sync": "moe_lora_rl.bench.sync",
    "recompute": "moe_lora_rl.bench.recompute",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m moe_lora_rl.bench {{{','.join(BENCHES)}}} [--json] [--model DIR] [--layouts ...]",
              file=sys.stderr)
        return 2
    from ..rl.console import quiet_progress

    quiet_progress()            # a model built on first use writes no progress bars: one JSON line, or one error line
    try:
        importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
    except ValueError as e:                          # a bad argument or input: one line, no traceback
        print(f"bench {argv[0]}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
