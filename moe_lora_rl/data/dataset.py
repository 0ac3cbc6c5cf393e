"""Datasets in verl's row format (what verl's RLHFDataset and reward managers read), from parquet or JSONL:

    {"data_source": str, "prompt": [{"role": "user", "content": str}, ...] | str,
     "reward_model": {"style": "rule", "ground_truth": <any JSON value>}, "extra_info": {...}, ...}

    rows = read_rows("train.parquet")                  # ValueError naming the file, a missing column or a bad row
    examples = examples_from_rows(rows, where="train.parquet")
    examples = load_examples(["a.parquet", "b.jsonl"])   # several files: their rows in order

An Example is what the job trains on, whatever the task: its prompt (chat messages or a string), the ground truth,
data_source and extra_info handed to the reward unchanged, and its row number. The built-in tasks become rows like
any other (`task_rows`, and `python -m moe_lora_rl.data NAME OUT_DIR` writes them); nothing here asks which task a
row is. A row's reference answer (data.reference_key, e.g. extra_info.answer for gsm8k's worked solution) feeds
the warm start.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUIRED = ("data_source", "prompt", "reward_model")
"""The columns verl's reader and reward managers need (data.prompt_key, reward_model.ground_truth, data.reward_fn_key
data_source); extra_info is optional ({} when absent), as in verl."""
FORMATS = (".parquet", ".jsonl", ".json")


@dataclass(frozen=True)
class Example:
    prompt: Any                   # chat messages (tuple of {"role", "content"} dicts) or a string
    ground_truth: Any             # reward_model.ground_truth, any JSON value, handed to the reward as is
    data_source: str
    index: int                    # the row's position in its dataset (after filtering: still the file's row)
    extra_info: dict = field(default_factory=dict, compare=False, hash=False)
    reference: str | None = None  # data.reference_key's value: a worked answer for the warm start

    @property
    def messages(self) -> list[dict]:
        """The prompt as chat messages (a string prompt is one user message, as verl's chat template gets it)."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [dict(m) for m in self.prompt]

    @property
    def answer(self):
        """The ground truth (the name the built-in task's helpers use)."""
        return self.ground_truth


def _read_table(path: Path) -> tuple[list[str], list[dict]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return table.column_names, table.to_pylist()
    rows = []
    with open(path) as f:
        if path.suffix == ".json":
            data = json.load(f)
            rows = data if isinstance(data, list) else [data]
        else:
            for n, line in enumerate(f):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"line {n + 1}: {e}") from None
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError("not every row is a JSON object")
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return cols, rows


def read_rows(path: str | Path, prompt_key: str = "prompt") -> list[dict]:
    """The rows of a dataset file (.parquet, .jsonl or .json); ValueError naming the file if it cannot be read,
    lacks verl's columns (naming them), is empty or has a row without a prompt or a ground truth (naming the row)."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"dataset file {str(path)!r}: unknown format {path.suffix!r} (read: {FORMATS})")
    if not path.is_file():
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    try:
        cols, rows = _read_table(path)
    except ValueError as e:
        raise ValueError(f"dataset file {str(path)!r} does not parse as {path.suffix[1:]}: {e}") from None
    except Exception as e:  # noqa: BLE001  (pyarrow and the OS raise several types for unreadable files)
        raise ValueError(f"dataset file {str(path)!r} does not parse as {path.suffix[1:]}: "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    need = [prompt_key if c == "prompt" else c for c in REQUIRED]
    missing = [c for c in need if c not in cols]
    if missing:
        raise ValueError(f"dataset file {str(path)!r} lacks verl's columns {missing} (has {cols})")
    if not rows:
        raise ValueError(f"dataset file {str(path)!r} has no rows")
    for i, r in enumerate(rows):
        rm = r.get("reward_model")
        if not isinstance(rm, dict) or rm.get("ground_truth") is None:
            raise ValueError(f"dataset file {str(path)!r} row {i}: no reward_model.ground_truth")
        if not _prompt_ok(r.get(prompt_key)):
            raise ValueError(f"dataset file {str(path)!r} row {i}: {prompt_key} is neither a non-empty string nor "
                             "a list of chat messages ({'role', 'content'})")
        if not isinstance(r.get("data_source"), str) or not r["data_source"]:
            raise ValueError(f"dataset file {str(path)!r} row {i}: data_source is not a non-empty string")
    return rows


def _prompt_ok(p) -> bool:
    if isinstance(p, str):
        return bool(p.strip())
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in p)


def lookup(row: dict, key: str):
    """A dotted key's value in a row (extra_info.answer), None when any part is absent."""
    node = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _frozen(v):
    """A JSON value made hashable (Examples are frozen): lists -> tuples, dicts kept inside tuples of messages."""
    if isinstance(v, list):
        return tuple(_frozen(x) for x in v)
    return v


def examples_from_rows(rows: list[dict], prompt_key: str = "prompt", reference_key: str | None = None,
                       where: str = "dataset") -> list[Example]:
    out = []
    for i, r in enumerate(rows):
        ref = None
        if reference_key is not None:
            ref = lookup(r, reference_key)
            if not isinstance(ref, str):
                raise ValueError(f"{where} row {i}: data.reference_key={reference_key!r} is not a string there "
                                 f"(got {type(ref).__name__})")
        p = r[prompt_key]
        out.append(Example(prompt=p if isinstance(p, str) else tuple(dict(m) for m in p),
                           ground_truth=_frozen(r["reward_model"]["ground_truth"]), data_source=r["data_source"],
                           index=i, extra_info=dict(r.get("extra_info") or {}), reference=ref))
    return out


def load_examples(files, prompt_key: str = "prompt", reference_key: str | None = None) -> list[Example]:
    """The Examples of one file or a list of files, in order (indices count across the files)."""
    files = [files] if isinstance(files, (str, Path)) else list(files)
    rows = []
    for f in files:
        rows += read_rows(f, prompt_key)
    return examples_from_rows(rows, prompt_key, reference_key, where=", ".join(map(str, files)))


# -- the built-in tasks as rows -----------------------------------------------------------------------------------
def to_row(problem, split: str) -> dict:
    """A built-in task's problem (data/task.py) as a verl row; its reference is the ground truth itself."""
    return {"data_source": problem.data_source, "prompt": problem.messages, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": problem.answer},
            "extra_info": {"split": split, "index": problem.index, "digits": list(problem.digits)}}


def task_rows(spec, split: str) -> list[dict]:
    from .task import make_split

    return [to_row(p, split) for p in make_split(spec, split)]


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Rows to a parquet (or .jsonl) file in verl's format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_parquet(spec, split: str, path: str | Path) -> Path:
    return write_rows(task_rows(spec, split), path)
