"""What a run starts from (rank 0 decides, every rank uses): the model checkpoint with its warm start, and the
training and held-out problems."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from .config import TrainConfig
from .preflight import base_model_dir
from .task import make_split


def model_dir(cfg: TrainConfig) -> tuple[Path, dict]:
    """The checkpoint the run starts from, and its warm start: the seconds it took (measured now, or recorded when
    it was trained, if cached) and whether it was cached."""
    if cfg.model.path is not None or not cfg.model.warm_start:
        return base_model_dir(cfg), {"warmup_s": 0.0, "warmup_cached": False, "warm_start": False}
    from .warm_start import task_warm_spec, warm_started

    t0 = time.perf_counter()
    spec = task_warm_spec(cfg.model.size, cfg.data.task_spec())
    if cfg.model.warm_steps is not None:
        spec = replace(spec, steps=cfg.model.warm_steps)
    path = warm_started(cfg.model.family, cfg.model.size, spec)
    took = time.perf_counter() - t0
    recorded = json.loads((path / "moe_lora_rl_warm_start.json").read_text())["train_wall_s"]
    cached = took < 0.5 * recorded
    return path, {"warmup_s": recorded if cached else took, "warmup_cached": cached, "warm_start": True}


def load_problems(cfg: TrainConfig):
    from .dataset import problems_from_rows, read_rows

    spec = cfg.data.task_spec()
    train = problems_from_rows(read_rows(cfg.data.train_file)) if cfg.data.train_file else make_split(spec, "train")
    held = problems_from_rows(read_rows(cfg.data.eval_file)) if cfg.data.eval_file else make_split(spec, "eval")
    return train, held
