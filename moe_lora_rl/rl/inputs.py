"""What a run starts from (rank 0 decides, every rank uses): the model checkpoint with its warm start, and the
training and held-out problems."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from .config import TrainConfig


def base_model_dir(cfg: TrainConfig) -> Path:
    """The checkpoint whose architecture the run trains (the warm start keeps the base's config)."""
    if cfg.model.path is not None:
        p = Path(cfg.model.path)
        if not (p / "config.json").is_file():
            raise ValueError(f"model.path={cfg.model.path!r} has no config.json (not an HF checkpoint directory)")
        return p
    from ..models import get_model

    return get_model(cfg.model.family, cfg.model.size)


def model_dir(cfg: TrainConfig) -> tuple[Path, dict]:
    """The checkpoint the run starts from, and its warm start: the seconds it took (measured now, or recorded when
    it was trained, if cached) and whether it was cached. The built-in model learns the built-in task, or a
    dataset's answer format from its data.reference_key column (none without one); model.path takes none."""
    if cfg.model.path is not None or not cfg.model.warm_start:
        return base_model_dir(cfg), {"warmup_s": 0.0, "warmup_cached": False, "warm_start": False}
    from ..data.warm_start import data_warm_spec, task_warm_spec, warm_started

    d = cfg.data
    if d.train_files is not None and d.reference_key is None:     # nothing to learn the answer format from
        return base_model_dir(cfg), {"warmup_s": 0.0, "warmup_cached": False, "warm_start": False}
    t0 = time.perf_counter()
    spec = task_warm_spec(cfg.model.size, d.task_spec(), cfg.model.family) if d.train_files is None else \
        data_warm_spec(cfg.model.size, d.train_files, d.prompt_key, d.reference_key, cfg.model.family)
    if cfg.model.warm_steps is not None:
        spec = replace(spec, steps=cfg.model.warm_steps)
    path = warm_started(cfg.model.family, cfg.model.size, spec)
    took = time.perf_counter() - t0
    recorded = json.loads((path / "moe_lora_rl_warm_start.json").read_text())["train_wall_s"]
    cached = took < 0.5 * recorded
    return path, {"warmup_s": recorded if cached else took, "warmup_cached": cached, "warm_start": True}


def load_problems(cfg: TrainConfig, tokenizer=None, template: str = "chat"):
    """The training and held-out Examples (data/dataset.py): data.train_files / data.val_files, or the built-in task's
    splits as rows, read the same way. With data.filter_overlong_prompts (and a tokenizer) the rows whose prompt is
    over data.max_prompt_length are left out (ValueError when none remain); the count is returned too:
    (train, held, {"train": left out, "val": left out})."""
    from ..data.dataset import examples_from_rows, load_examples, task_rows

    d = cfg.data
    out, dropped = [], {}
    for split, task_split in (("train", "train"), ("val", "eval")):
        files = d.files(split)
        if files is None:
            ex = examples_from_rows(task_rows(d.task_spec(), task_split), reference_key=d.reference_key,
                                    where=f"data.task={d.task} {task_split}")
        else:
            ex = load_examples(files, d.prompt_key, d.reference_key)
        if d.filter_overlong_prompts and tokenizer is not None:
            from ..data.prompting import prompt_lengths

            n = len(ex)
            ex = [e for e, k in zip(ex, prompt_lengths(tokenizer, ex, template)) if k <= d.max_prompt_length]
            dropped[split] = n - len(ex)
            if not ex:
                raise ValueError(f"data.filter_overlong_prompts: every one of the {n} {split} prompts is longer than "
                                 f"data.max_prompt_length={d.max_prompt_length} tokens (raise it)")
        out.append(ex)
    return out[0], out[1], dropped
