"""The synthetic verifiable task: add two n-digit numbers written digit by digit.

    "3 7 + 4 5 ="  ->  "8 2"

Digits are separated by spaces so every digit is one token of the project's byte-level BPE (" 7"), and the same
sum always tokenizes the same way. Problems are unordered pairs {a, b}; a seeded shuffle of all pairs gives a
held-out split first and the training split from the rest, so no pair (in either order) is in both.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from .reward import DATA_SOURCE  # noqa: F401  (the task's data_source, defined next to its scorer)


@dataclass(frozen=True)
class TaskSpec:
    digits: int = 2          # operand length; operands have no leading zero
    n_eval: int = 256        # held-out problems
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.digits <= 4:
            raise ValueError(f"task digits={self.digits} is outside 1..4")
        n_pairs = self.num_pairs()
        if not 0 < self.n_eval < n_pairs // 2:
            raise ValueError(f"task n_eval={self.n_eval} must be in 1..{n_pairs // 2 - 1} for digits={self.digits}")

    def operand_range(self) -> range:
        lo = 1 if self.digits == 1 else 10 ** (self.digits - 1)
        return range(lo, 10 ** self.digits)

    def num_pairs(self) -> int:
        n = len(self.operand_range())
        return n * (n + 1) // 2


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    index: int               # position in its split

    @property
    def question(self) -> str:
        return f"{spaced(self.a)} + {spaced(self.b)} ="

    @property
    def answer(self) -> str:
        return spaced(self.a + self.b)


def spaced(n: int) -> str:
    return " ".join(str(n))


def _pairs(spec: TaskSpec) -> list[tuple[int, int]]:
    r = spec.operand_range()
    pairs = [(a, b) for a in r for b in r if a <= b]
    random.Random(f"addition:{spec.digits}:{spec.seed}").shuffle(pairs)
    return pairs


def make_split(spec: TaskSpec, split: str) -> list[Problem]:
    """'eval': the held-out problems; 'train': all others. Each unordered pair is shown in a seeded random order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r} is not 'train' or 'eval'")
    pairs = _pairs(spec)
    chosen = pairs[:spec.n_eval] if split == "eval" else pairs[spec.n_eval:]
    rng = random.Random(f"order:{split}:{spec.digits}:{spec.seed}")
    out = []
    for i, (a, b) in enumerate(chosen):
        if rng.random() < 0.5:
            a, b = b, a
        out.append(Problem(a, b, i))
    return out


def messages(problem: Problem) -> list[dict]:
    return [{"role": "user", "content": problem.question}]
