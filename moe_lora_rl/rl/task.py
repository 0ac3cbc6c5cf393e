"""The synthetic verifiable task: add two n-digit numbers written digit by digit, least significant digit first.

    "7 3 + 5 4 ="  ->  "2 8"          (37 + 45 = 82)

Least-significant-first order lets a left-to-right model emit each digit after the carry that decides it (the
order in which small transformers learn addition fastest). Digits are separated by spaces so every digit is one
token of the project's byte-level BPE (" 7"); that BPE has no " 0" token, so the task uses only numbers whose digits
are 1-9, operands and sum alike, and every problem of a size tokenizes to the same length.

Problems are unordered pairs {a, b}; a seeded shuffle of all pairs gives the held-out split first and the training
split from the rest, so no pair (in either order) is in both.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from .reward import DATA_SOURCE  # noqa: F401  (the task's data_source, defined next to its scorer)


@dataclass(frozen=True)
class TaskSpec:
    digits: int = 2          # operand length
    n_eval: int = 256        # held-out problems
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.digits <= 3:
            raise ValueError(f"task digits={self.digits} is outside 1..3")
        n_pairs = self.num_pairs()
        if not 0 < self.n_eval <= n_pairs // 4:
            raise ValueError(f"task n_eval={self.n_eval} must be in 1..{n_pairs // 4} for digits={self.digits} "
                             f"({n_pairs} problems; at most a quarter are held out)")

    def num_pairs(self) -> int:
        return len(_all_pairs(self.digits))


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
    """Digits least significant first, separated by spaces: 82 -> '2 8'."""
    return " ".join(reversed(str(n)))


def _no_zero(n: int) -> bool:
    return "0" not in str(n)


@functools.lru_cache(maxsize=None)
def _all_pairs(digits: int) -> tuple[tuple[int, int], ...]:
    ops = [n for n in range(10 ** (digits - 1), 10 ** digits) if _no_zero(n)]
    return tuple((a, b) for i, a in enumerate(ops) for b in ops[i:] if _no_zero(a + b))


def make_split(spec: TaskSpec, split: str) -> list[Problem]:
    """'eval': the held-out problems; 'train': all others. Each unordered pair is shown in a seeded random order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r} is not 'train' or 'eval'")
    pairs = list(_all_pairs(spec.digits))
    random.Random(f"addition:{spec.digits}:{spec.seed}").shuffle(pairs)
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
