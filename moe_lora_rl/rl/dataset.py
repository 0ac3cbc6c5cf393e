"""The task as parquet in verl's row format (what verl's RLHFDataset and reward managers read):

    {"data_source": str, "prompt": [{"role": "user", "content": str}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": str}, "extra_info": {"split", "index", "digits"}}
"""
from __future__ import annotations

from pathlib import Path

from .task import SOURCES, Problem, TaskSpec, make_split, messages

REQUIRED = ("data_source", "prompt", "reward_model", "extra_info")


def to_row(problem: Problem, split: str) -> dict:
    return {"data_source": problem.data_source, "prompt": messages(problem), "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": problem.answer},
            "extra_info": {"split": split, "index": problem.index, "digits": list(problem.digits)}}


def write_parquet(spec: TaskSpec, split: str, path: str | Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [to_row(p, split) for p in make_split(spec, split)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a task parquet file; ValueError naming the file if it does not parse or lacks verl's columns."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001  (pyarrow raises several types for unreadable files)
        raise ValueError(f"dataset file {path} does not parse as parquet: {type(e).__name__}: {e}") from None
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise ValueError(f"dataset file {path} lacks verl columns {missing} (has {table.column_names})")
    rows = table.to_pylist()
    for i, r in enumerate(rows):
        gt = (r["reward_model"] or {}).get("ground_truth")
        if not isinstance(gt, str) or not isinstance(r["prompt"], list) or not r["prompt"]:
            raise ValueError(f"dataset file {path} row {i} has no chat prompt or no reward_model.ground_truth")
    return rows


def problems_from_rows(rows: list[dict]) -> list[Problem]:
    kinds = {src: kind for kind, src in SOURCES.items()}
    return [Problem(tuple(int(d) for d in r["extra_info"]["digits"]), int(r["extra_info"]["index"]),
                    kinds.get(r["data_source"], "sort")) for r in rows]


def main(argv=None) -> int:
    """python -m moe_lora_rl.rl.dataset OUT_DIR [--length N] [--n-eval N] [--seed S]: write train.parquet and
    eval.parquet for verl (data.train_files / data.val_files; reward: custom_reward_function.path =
    pkg://moe_lora_rl.rl.reward, name = compute_score)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m moe_lora_rl.rl.dataset")
    p.add_argument("out_dir")
    p.add_argument("--task", default=TaskSpec.kind, help="sort, sort_trace or sort_long")
    p.add_argument("--mix", default=None, help="sort_long: the size mix (a name or 'lo-hi:weight,...')")
    p.add_argument("--length", type=int, default=TaskSpec.length)
    p.add_argument("--n-eval", type=int, default=TaskSpec.n_eval)
    p.add_argument("--seed", type=int, default=TaskSpec.seed)
    a = p.parse_args(argv)
    try:
        spec = TaskSpec(length=a.length, n_eval=a.n_eval, seed=a.seed, kind=a.task, mix=a.mix)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split in ("train", "eval"):
        print(write_parquet(spec, split, Path(a.out_dir) / f"{split}.parquet"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
