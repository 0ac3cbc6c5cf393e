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

The long-reasoning variant, kind="sort_long", writes the same trace; its reward is the final result the trace
writes, the sorted list read off the lines (each line's first digit), verified exactly: the remainders are the
working, not graded. Its list sizes are drawn from a skewed mix (`mix`, MIXES["long"] by default: 70% of 8-13
digits, 30% of 14-25), so response lengths have a heavy tail: about 60 tokens at 8 digits, 115 at 12, 320 at 22 and
400 at 25 (the trace grows with the square of the size).
"""
from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass

from .reward import DATA_SOURCE, LONG_SOURCE, TRACE_SOURCE  # the tasks' data_source, next to their scorer

DIGITS = tuple(range(1, 10))
KINDS = ("sort", "sort_trace", "sort_long")
LENGTHS = {"sort": (3, 6), "sort_trace": (8, 12), "sort_long": (2, 25)}
MIXED = ("sort_long",)                  # kinds whose list sizes come from a mix, not from `length`
MIXES = {"long": "8-13:0.7,14-25:0.3", "medium": "6-9:0.7,10-14:0.3"}
"""Named size mixes: comma-separated `lo-hi:weight` segments (a size is drawn uniform in lo..hi, the segment with
probability weight / sum of weights)."""
TRACE_TRAIN_SIZE = 50_000
SOURCES = {"sort": DATA_SOURCE, "sort_trace": TRACE_SOURCE, "sort_long": LONG_SOURCE}


def parse_mix(mix: str, lengths: tuple[int, int] = LENGTHS["sort_long"]) -> tuple[tuple[int, int, float], ...]:
    """A mix's segments ((lo, hi, probability), ...), from a name in MIXES or `lo-hi:weight,...`; ValueError naming
    the mix when it does not parse or leaves `lengths`."""
    text = MIXES.get(mix, mix)
    segs = []
    try:
        for part in text.split(","):
            span, w = part.split(":")
            lo, hi = (int(x) for x in span.split("-"))
            segs.append((lo, hi, float(w)))
    except ValueError:
        raise ValueError(f"size mix {mix!r} is neither a name in {sorted(MIXES)} nor 'lo-hi:weight,...' "
                         "(e.g. '8-13:0.7,14-24:0.3')") from None
    a, b = lengths
    for lo, hi, w in segs:
        if not (a <= lo <= hi <= b) or not w > 0:
            raise ValueError(f"size mix {mix!r}: segment {lo}-{hi}:{w:g} needs {a} <= lo <= hi <= {b} and a weight > 0")
    total = sum(w for _, _, w in segs)
    return tuple((lo, hi, w / total) for lo, hi, w in segs)


def draw_size(segments, rng: random.Random) -> int:
    u, acc = rng.random(), 0.0
    for lo, hi, p in segments:
        acc += p
        if u < acc:
            return rng.randint(lo, hi)
    lo, hi, _ = segments[-1]
    return rng.randint(lo, hi)


@dataclass(frozen=True)
class TaskSpec:
    length: int = 5          # digits per list (answer: length tokens + end of turn)
    n_eval: int = 256        # held-out problems (= held-out multisets)
    seed: int = 0
    kind: str = "sort"       # "sort" (the answer), "sort_trace" (the written selection sort), "sort_long"
    mix: str | None = None   # sort_long: the size mix (MIXES name or 'lo-hi:weight,...'; None: "long")

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"task kind={self.kind!r} is not one of {KINDS}")
        if self.kind in MIXED:
            if self.mix is None:                  # one spelling of the default (warm starts are cached by spec)
                object.__setattr__(self, "mix", "long")
            parse_mix(self.mix)
            if not 0 < self.n_eval <= 4096:
                raise ValueError(f"task n_eval={self.n_eval} must be in 1..4096 for kind={self.kind}")
            return
        if self.mix is not None:
            raise ValueError(f"task mix={self.mix!r} applies to kinds {MIXED} only, not kind={self.kind} (its lists "
                             "have `length` digits)")
        lo, hi = LENGTHS[self.kind]
        if not lo <= self.length <= hi:
            raise ValueError(f"task length={self.length} is outside {lo}..{hi} for kind={self.kind}")
        n = len(_multisets(self.length))
        if not 0 < self.n_eval <= n // 4:
            raise ValueError(f"task n_eval={self.n_eval} must be in 1..{n // 4} for length={self.length} "
                             f"({n} multisets; at most a quarter are held out)")

    def sizes(self) -> tuple[int, int]:
        """The smallest and the largest list of the task."""
        if self.kind in MIXED:
            segs = parse_mix(self.mix)
            return min(s[0] for s in segs), max(s[1] for s in segs)
        return self.length, self.length


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
        result = " ".join(map(str, sorted(self.digits)))
        if self.kind in ("sort_trace", "sort_long"):
            return trace(self.digits)
        return result

    @property
    def data_source(self) -> str:
        return SOURCES[self.kind]

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.question}]


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


@functools.lru_cache(maxsize=None)
def _mixed_split(mix: str, n_eval: int, seed: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Held-out and training lists of a size mix: held-out lists drawn like training prompts (size from the mix,
    digits uniform), one per multiset; training: TRACE_TRAIN_SIZE seeded draws whose multiset is not held out."""
    segs, mix = parse_mix(mix), MIXES.get(mix, mix)     # a name and its spelling out: one split (and warm start)

    def draws(tag):
        rng = random.Random(f"sort_long:{tag}:{mix}:{seed}")
        while True:
            yield tuple(rng.choice(DIGITS) for _ in range(draw_size(segs, rng)))

    held, seen = [], set()
    for s in draws("eval"):
        if tuple(sorted(s)) not in seen:
            seen.add(tuple(sorted(s)))
            held.append(s)
            if len(held) == n_eval:
                break
    train = []
    for s in draws("train"):
        if tuple(sorted(s)) not in seen:
            train.append(s)
            if len(train) == TRACE_TRAIN_SIZE:
                break
    return tuple(held), tuple(train)


def make_split(spec: TaskSpec, split: str) -> list[Problem]:
    """'eval': the held-out lists; 'train': every list whose multiset is not held out, in a seeded order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r} is not 'train' or 'eval'")
    if spec.kind in MIXED:
        held, train = _mixed_split(spec.mix, spec.n_eval, spec.seed)
        return [Problem(s, i, spec.kind) for i, s in enumerate(held if split == "eval" else train)]
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
