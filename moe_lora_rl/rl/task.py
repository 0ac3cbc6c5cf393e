"""The synthetic verifiable task: sort a list of digits in ascending order.

    "sort 3 1 4 1 5"  ->  "1 1 3 4 5"

Digits are 1-9 separated by spaces, so each is one token of the project's byte-level BPE (" 7"; that BPE has no
" 0" token) and every prompt of a length tokenizes to the same number of tokens (23 for length 5, with the chat
template). A small model learns the task in tens of supervised steps, which lets the warm start stop early at a
low success rate and leaves RL a task it can improve quickly on a CPU.

Held-out problems are held out by multiset: the held-out lists are drawn like training prompts (uniform over lists),
one per multiset, and training uses every list whose multiset is not held out. No held-out list, nor any
permutation of it, is a training prompt.

The long-form variant, kind="sort_trace" (lists of 8-12 digits), answers with a written selection sort: one line per
step, the smallest digit left, a bar, then the digits still left in their order; the reward is the exact trace.

    "sort 3 1 4 1"  ->  " 1 | 3 4 1\n 1 | 3 4\n 3 | 4\n 4 |"

Every line reads the line before it, so the trace is a long response (75 tokens for 10 digits) whose next step
needs only its recent context: the kind of long reasoning a compressed KV cache is built for (Sparse-RL). There are
too many lists to enumerate: its training split is a fixed seeded draw of TRACE_TRAIN_SIZE lists.
"""
from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass

from .reward import DATA_SOURCE, TRACE_SOURCE  # the tasks' data_source, defined next to their scorer

DIGITS = tuple(range(1, 10))
KINDS = ("sort", "sort_trace")
LENGTHS = {"sort": (3, 6), "sort_trace": (8, 12)}
TRACE_TRAIN_SIZE = 50_000


@dataclass(frozen=True)
class TaskSpec:
    length: int = 5          # digits per list (answer: length tokens + end of turn)
    n_eval: int = 256        # held-out problems (= held-out multisets)
    seed: int = 0
    kind: str = "sort"       # "sort" (the answer) or "sort_trace" (the written selection sort)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"task kind={self.kind!r} is not one of {KINDS}")
        lo, hi = LENGTHS[self.kind]
        if not lo <= self.length <= hi:
            raise ValueError(f"task length={self.length} is outside {lo}..{hi} for kind={self.kind}")
        n = len(_multisets(self.length))
        if not 0 < self.n_eval <= n // 4:
            raise ValueError(f"task n_eval={self.n_eval} must be in 1..{n // 4} for length={self.length} "
                             f"({n} multisets; at most a quarter are held out)")


@dataclass(frozen=True)
class Problem:
    digits: tuple[int, ...]
    index: int               # position in its split
    kind: str = "sort"

    @property
    def question(self) -> str:
        return "sort " + " ".join(map(str, self.digits))

    @property
    def answer(self) -> str:
        if self.kind == "sort_trace":
            return trace(self.digits)
        return " ".join(map(str, sorted(self.digits)))

    @property
    def data_source(self) -> str:
        return TRACE_SOURCE if self.kind == "sort_trace" else DATA_SOURCE


def trace(digits) -> str:
    """The written selection sort of `digits`: per step " m |" and the digits left, in order; lines joined by \n."""
    left, lines = list(digits), []
    while left:
        m = min(left)
        left.remove(m)
        lines.append(f" {m} |" + "".join(f" {d}" for d in left))
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def _multisets(length: int) -> tuple[tuple[int, ...], ...]:
    return tuple(itertools.combinations_with_replacement(DIGITS, length))


@functools.lru_cache(maxsize=None)
def _held_out(length: int, n_eval: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """The first n_eval lists of a seeded shuffle of all lists, skipping repeats of a multiset: held-out lists are
    drawn like training prompts (uniform over lists, not over multisets). Lists longer than 6: seeded uniform draws
    (too many to shuffle)."""
    if length > 6:
        rng = random.Random(f"sort:{length}:{seed}")
        seqs = (tuple(rng.choice(DIGITS) for _ in range(length)) for _ in itertools.count())
    else:
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
        return [Problem(s, i, spec.kind) for i, s in enumerate(held)]
    held_set = {tuple(sorted(s)) for s in held}
    if spec.length > 6:
        rng = random.Random(f"train-draw:{spec.length}:{spec.seed}")
        seqs = []
        while len(seqs) < TRACE_TRAIN_SIZE:
            s = tuple(rng.choice(DIGITS) for _ in range(spec.length))
            if tuple(sorted(s)) not in held_set:
                seqs.append(s)
    else:
        seqs = [s for s in itertools.product(DIGITS, repeat=spec.length) if tuple(sorted(s)) not in held_set]
        random.Random(f"train-order:{spec.length}:{spec.seed}").shuffle(seqs)
    return [Problem(s, i, spec.kind) for i, s in enumerate(seqs)]


def messages(problem: Problem) -> list[dict]:
    return [{"role": "user", "content": problem.question}]
