"""The data and reward sections of the run config (verl's names and defaults: verl/trainer/config/data/
legacy_data.yaml, reward.custom_reward_function), validated in __post_init__ (ValueError naming the value).

    data.train_files / data.val_files: a file or a list (parquet, JSONL) in verl's row format; null: the built-in
    task data.task, generated as rows and read like any file.  reward.path / reward.name: a function with verl's
    signature; null: verl's default_compute_score with gsm8k and math_dapo read in full (data/rewards.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .rollout_settings import _choice, _positive

TRUNCATION = ("error", "left", "right", "middle")


def _files(key: str, value) -> list[str] | None:
    if value is None:
        return None
    files = [value] if isinstance(value, str) else list(value)
    if not files or not all(isinstance(f, str) and f for f in files):
        raise ValueError(f"{key}={value!r}: a file or a list of files")
    return files


@dataclass
class DataSettings:
    task: str = "sort"
    """The built-in task trained on when no data.train_files are given (moe_lora_rl.data.task): sort (answer the
    sorted list), sort_trace (write the selection sort out: a long response, 8-12 digits), sort_long (the
    long-reasoning task: the written selection sort of a list whose size comes from data.mix, rewarded on the sorted
    result it writes; responses of 60-400 tokens). `python -m moe_lora_rl.data NAME OUT_DIR` writes it as files."""
    length: int = 5
    """Digits per list of the sorting task (moe_lora_rl.data.task); sort_long draws its sizes from data.mix."""
    mix: Optional[str] = None
    """sort_long: the list-size mix, a name (long: 70% of 8-13 digits, 30% of 14-25) or 'lo-hi:weight,...'; null:
    long. Refused for the fixed-length tasks."""
    n_eval: int = 256
    """Held-out problems of the built-in task."""
    eval_samples: int = 4
    """Responses per held-out problem at each evaluation (sampled at the training temperature, seeds fixed for the
    run); success is their mean."""
    prompt_template: str = "auto"
    """How prompts become ids (data/prompting.py): chat (the tokenizer's chat template), plain (the messages' contents
    and a newline, for checkpoints without a chat template), auto (chat if the tokenizer has one, else plain)."""
    train_files: Any = None
    """verl's data.train_files: a file or a list of files (.parquet, .jsonl) in verl's row format (data_source,
    prompt, reward_model.ground_truth, extra_info); null: the built-in task. Shuffled from the run's seed, one
    permutation per epoch."""
    val_files: Any = None
    """verl's data.val_files: the held-out rows (needed with train_files)."""
    train_file: Optional[str] = None
    """Alias of data.train_files (one file)."""
    eval_file: Optional[str] = None
    """Alias of data.val_files (one file)."""
    prompt_key: str = "prompt"
    """verl's data.prompt_key: the column holding the prompt (chat messages or a string)."""
    max_prompt_length: int = 512
    """verl's data.max_prompt_length: the most prompt tokens (after the chat template)."""
    filter_overlong_prompts: bool = False
    """verl's data.filter_overlong_prompts: leave out the rows whose prompt is longer than max_prompt_length
    (counted in one line; refused when none remain); false: data.truncation decides."""
    truncation: str = "error"
    """verl's data.truncation for a prompt over max_prompt_length: error (refused, naming its row), left (keep its
    last tokens), right (its first), middle (both ends)."""
    reference_key: Optional[str] = None
    """The column (dotted: extra_info.answer) holding a worked reference answer: the built-in model's warm start
    learns the dataset's answer format from it (data/warm_start.py). null with train_files: no warm start."""

    def task_spec(self):
        from ...data.task import TaskSpec

        return TaskSpec(length=self.length, n_eval=self.n_eval, kind=self.task, mix=self.mix)

    def files(self, split: str) -> list[str] | None:
        """The files of 'train' or 'val' (the alias folded in); None: the built-in task."""
        return self.train_files if split == "train" else self.val_files

    def __post_init__(self):
        self.task_spec()
        from ...data.prompting import TEMPLATES

        _choice("data.prompt_template", self.prompt_template, TEMPLATES)
        _choice("data.truncation", self.truncation, TRUNCATION)
        if not isinstance(self.eval_samples, int) or isinstance(self.eval_samples, bool) or self.eval_samples < 1:
            raise ValueError(f"data.eval_samples={self.eval_samples!r} must be an integer >= 1")
        if not isinstance(self.max_prompt_length, int) or self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length!r} must be an integer >= 1")
        for new, old in (("train_files", "train_file"), ("val_files", "eval_file")):
            a, b = getattr(self, new), getattr(self, old)
            if a is not None and b is not None:
                raise ValueError(f"data.{new} and data.{old} are both given; {old} is an alias of {new}: use one")
            setattr(self, new, _files(f"data.{new}", a if a is not None else b))
            setattr(self, old, None)              # folded in: one spelling from here on
        from ...data.dataset import load_examples

        for split in ("train", "val"):        # parsed now: a bad file fails before any process group starts
            if self.files(split) is not None:
                load_examples(self.files(split), self.prompt_key, self.reference_key)
        if (self.train_files is None) != (self.val_files is None):
            raise ValueError("data.train_files and data.val_files go together (held-out success is measured on "
                             f"val_files); got train_files={self.train_files!r}, val_files={self.val_files!r}")


@dataclass
class RewardSettings:
    path: Optional[str] = None
    """verl's reward.custom_reward_function.path: a Python file or pkg://module holding the reward function; null:
    verl's default_compute_score (by data_source; gsm8k and math_dapo read in full, the built-in tasks' sources by
    their own scorer: data/rewards.py)."""
    name: str = "compute_score"
    """The function's name: compute_score(data_source, solution_str, ground_truth, extra_info) -> float or a dict
    with 'score' (its other numeric keys logged as metrics)."""
    timeout_s: float = 30.0
    """Seconds one call may take; past it the run stops, naming the row."""
    workers: int = 1
    """Reward worker processes (rank 0's; the calls run there, off the trainer)."""

    def __post_init__(self):
        _positive("reward.timeout_s", self.timeout_s)
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"reward.workers={self.workers!r} must be an integer >= 1")
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"reward.name={self.name!r} is not a function name")
