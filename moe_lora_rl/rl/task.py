"""The synthetic verifiable task: sort a list of digits in ascending order.

    "sort 3 1 4 1 5"  ->  "1 1 3 4 5"

Digits are 1-9 separated by spaces, so each is one token of the project's byte-level BPE (" 7"; that BPE has no
" 0" token) and every prompt of a length tokenizes to the same number of tokens (23 for length 5, with the chat
template). A small model learns the task in tens of supervised steps, which lets the warm start stop early at a
low success rate and leaves RL a task it can improve quickly on a CPU.

Held-out problems are held out by multiset: the held-out lists are drawn like training prompts (uniform over lists),
one per multiset, and training uses every list whose multiset is not held out. No held-out list, nor any
permutation of it, is a training prompt.
"""
from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass

from .reward import DATA_SOURCE  # noqa: F401  (the task's data_source, defined next to its scorer)

DIGITS = tuple(range(1, 10))


@dataclass(frozen=True)
class TaskSpec:
    length: int = 5          # digits per list (answer: length tokens + end of turn)
    n_eval: int = 256        # held-out problems (= held-out multisets)
    seed: int = 0

    def __post_init__(self):
        if not 3 <= self.length <= 6:
            raise ValueError(f"task length={self.length} is outside 3..6")
        n = len(_multisets(self.length))
        if not 0 < self.n_eval <= n // 4:
            raise ValueError(f"task n_eval={self.n_eval} must be in 1..{n // 4} for length={self.length} "
                             f"({n} multisets; at most a quarter are held out)")


@dataclass(frozen=True)
class Problem:
    digits: tuple[int, ...]
    index: int               # position in its split

    @property
    def question(self) -> str:
        return "sort " + " ".join(map(str, self.digits))

    @property
    def answer(self) -> str:
        return " ".join(map(str, sorted(self.digits)))


@functools.lru_cache(maxsize=None)
def _multisets(length: int) -> tuple[tuple[int, ...], ...]:
    return tuple(itertools.combinations_with_replacement(DIGITS, length))


@functools.lru_cache(maxsize=None)
def _held_out(length: int, n_eval: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """The first n_eval lists of a seeded shuffle of all lists, skipping repeats of a multiset: held-out lists are
    drawn like training prompts (uniform over lists, not over multisets)."""
    seqs = list(itertools.product(DIGITS, repeat=length))
    random.Random(f"sort:{length}:{seed}").shuffle(seqs)
    out, seen = [], set()
    for s in seqs:
        m = tuple(sorted(s))
        if m not in seen:
            seen.add(m)
            out.append(s)
            if len(out) == n_eval:
                break
    return tuple(out)


def make_split(spec: TaskSpec, split: str) -> list[Problem]:
    """'eval': the held-out lists; 'train': every list whose multiset is not held out, in a seeded order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r} is not 'train' or 'eval'")
    held = _held_out(spec.length, spec.n_eval, spec.seed)
    if split == "eval":
        return [Problem(s, i) for i, s in enumerate(held)]
    held_set = {tuple(sorted(s)) for s in held}
    seqs = [s for s in itertools.product(DIGITS, repeat=spec.length) if tuple(sorted(s)) not in held_set]
    random.Random(f"train-order:{spec.length}:{spec.seed}").shuffle(seqs)
    return [Problem(s, i) for i, s in enumerate(seqs)]


def messages(problem: Problem) -> list[dict]:
    return [{"role": "user", "content": problem.question}]
