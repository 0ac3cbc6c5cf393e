"""python -m moe_lora_rl.data NAME OUT_DIR: write a dataset's train and val files in verl's row format."""
from __future__ import annotations

import argparse
import sys

from . import DATASETS, REFERENCE_KEYS, write


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_lora_rl.data",
                                description="Write a dataset's train and val files in verl's row format.")
    p.add_argument("name", help=f"one of {sorted(DATASETS)}")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-eval", type=int, default=None, help="held-out rows")
    p.add_argument("--length", type=int, default=None, help="sort, sort_trace: digits per list")
    p.add_argument("--mix", default=None, help="sort_long: the size mix (a name or 'lo-hi:weight,...')")
    p.add_argument("--format", default="parquet", choices=("parquet", "jsonl"))
    a = p.parse_args(argv)
    try:
        paths = write(a.name, a.out_dir, fmt=a.format, seed=a.seed, n_eval=a.n_eval, length=a.length, mix=a.mix)
    except ValueError as e:
        print(f"{p.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for split, path in paths.items():
        print(f"{split}: {path}")
    ref = REFERENCE_KEYS.get(a.name)
    print(f"train with: data.train_files={paths['train']} data.val_files={paths['val']}"
          + (f" data.reference_key={ref}" if ref else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
