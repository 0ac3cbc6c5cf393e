"""Data and reward, below the RL run (imports nothing of rl/; docs/data.md): the built-in tasks (task.py) and their
scorer (reward.py), gsm8k-format problems (arith.py), the reader of verl's row format (dataset.py), the run's reward
in worker processes (rewards.py), prompts as ids (prompting.py), the warm start (warm_start.py) and plain HF
sampling (hf_sampling.py). Datasets in verl's row format, written to files the main job (data.train_files /
data.val_files) and verl's main_ppo read alike:

    python -m moe_lora_rl.data NAME OUT_DIR [--seed S] [--n-eval N] [--format parquet|jsonl]
        -> OUT_DIR/train.parquet, OUT_DIR/val.parquet

NAME: the built-in sorting tasks (sort, sort_trace, sort_long: their own scorer, data/reward.py) or gsm8k_arith
(arithmetic word problems in gsm8k's format, scored by the default reward's gsm8k scorer; data/arith.py). A dataset
is a table entry: a function of the options returning {"train": rows, "val": rows}.
"""
from __future__ import annotations

from pathlib import Path


def _sorting(kind: str):
    def rows(seed: int = 0, n_eval: int | None = None, length: int | None = None, mix: str | None = None):
        from .dataset import task_rows
        from .task import TaskSpec

        kw = {k: v for k, v in (("n_eval", n_eval), ("length", length), ("mix", mix)) if v is not None}
        spec = TaskSpec(seed=seed, kind=kind, **kw)
        return {"train": task_rows(spec, "train"), "val": task_rows(spec, "eval")}
    return rows


def _arith(level: str, n_eval_default: int):
    def rows(seed: int = 0, n_eval: int | None = None, length: int | None = None, mix: str | None = None):
        from .arith import splits

        if length is not None or mix is not None:
            raise ValueError("gsm8k_arith takes no --length or --mix (they size the sorting tasks' lists)")
        return splits(n_eval=n_eval_default if n_eval is None else n_eval, seed=seed, level=level)
    return rows


DATASETS = {"sort": _sorting("sort"), "sort_trace": _sorting("sort_trace"), "sort_long": _sorting("sort_long"),
            "gsm8k_arith": _arith("mixed", 128), "gsm8k_add1": _arith("add1", 32)}
REFERENCE_KEYS = {"gsm8k_arith": "extra_info.answer", "gsm8k_add1": "extra_info.answer"}
"""The column holding each dataset's worked answer (data.reference_key, for the warm start); the sorting tasks'
answer is the ground truth itself."""
JOB_OVERRIDES = {"gsm8k_arith": ["algo.max_response_tokens=16"],
                 "gsm8k_add1": ["algo.max_response_tokens=16", "model.warm_steps=150"]}
"""The main job's settings a dataset needs (its answers' length: the longest reference answer, "23 + 28 = 51\n####
51", is 16 tokens on the built-in tokenizer; preflight.check_answer_length refuses fewer) and its warm start
(gsm8k_add1: 150 steps, from which GRPO lifts held-out success by +0.23; after the default 60 nothing is learnt:
docs/data.md)."""


def write(name: str, out_dir: str | Path, *, fmt: str = "parquet", **options) -> dict[str, Path]:
    """Write dataset `name`'s train and val files; ValueError naming an unknown dataset or a bad option."""
    from .dataset import write_rows

    if name not in DATASETS:
        raise ValueError(f"dataset {name!r} is not one of {sorted(DATASETS)}")
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"--format {fmt!r}: parquet or jsonl")
    rows = DATASETS[name](**options)
    return {split: write_rows(r, Path(out_dir) / f"{split}.{fmt}") for split, r in rows.items()}
