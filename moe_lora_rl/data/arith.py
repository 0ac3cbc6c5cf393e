"""Arithmetic word problems in gsm8k's format, generated locally (no download), scored by the default reward's gsm8k
scorer (data_source openai/gsm8k: the number after the first "####" of the whole response;
integration/verl/reward_score.gsm8k_score).

    row = {"data_source": "openai/gsm8k",
           "prompt": [{"role": "user", "content": "Ann has 12 apples. She buys 7 more. How many apples does Ann have
                       now? Let's think step by step and output the final answer after \"####\"."}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": "19"},
           "extra_info": {"split": "train", "index": 0, "answer": "12 + 7 = 19\n#### 19", "question": "..."}}

The layout is verl's examples/data_preprocess/gsm8k.py's (its instruction, its extra_info.answer holding the worked
solution: data.reference_key=extra_info.answer for the warm start). Two numbers, one operation (+, -, *), small
enough for the built-in model to learn the format in a short warm start and leave RL the arithmetic. The held-out
problems are held out by (story, numbers): no held-out problem is a training one.
"""
from __future__ import annotations

import random

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
NAMES = ("Ann", "Ben", "Cal", "Dee", "Eva", "Finn", "Gus", "Ivy")
ITEMS = ("apples", "books", "coins", "pens", "cards", "shells")
STORIES = (
    ("+", "{n} has {a} {i}. {n} buys {b} more. How many {i} does {n} have now?"),
    ("+", "{n} picks {a} {i} in the morning and {b} {i} in the afternoon. How many {i} does {n} pick in all?"),
    ("-", "{n} has {a} {i}. {n} gives {b} of them away. How many {i} does {n} have left?"),
    ("-", "A box holds {a} {i}. {n} takes {b} out. How many {i} are still in the box?"),
    ("*", "{n} fills {a} bags with {b} {i} each. How many {i} does {n} have in the bags?"),
)
RANGES = {"+": ((2, 50), (2, 50)), "-": ((10, 60), (1, 9)), "*": ((2, 9), (2, 9))}
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
LEVELS = {"mixed": RANGES, "add1": {"+": ((1, 9), (1, 9))}}
"""A level: the operations drawn and their operands' ranges. mixed (gsm8k_arith): +, - and * as RANGES; add1
(gsm8k_add1): one-digit addition only (162 distinct (story, a, b): a small held-out split leaves the rest to train)."""


def problem(rng: random.Random, level: str = "mixed") -> tuple:
    ranges = LEVELS[level]
    stories = [k for k, (op, _) in enumerate(STORIES) if op in ranges]
    story = stories[rng.randrange(len(stories))]
    (alo, ahi), (blo, bhi) = ranges[STORIES[story][0]]
    return story, rng.randint(alo, ahi), rng.randint(blo, bhi), rng.randrange(len(NAMES)), rng.randrange(len(ITEMS))


def to_row(key: tuple, split: str, index: int) -> dict:
    story, a, b, n, i = key
    op, text = STORIES[story]
    question = text.format(n=NAMES[n], i=ITEMS[i], a=a, b=b)
    c = OPS[op](a, b)
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(c)},
            "extra_info": {"split": split, "index": index, "answer": f"{a} {op} {b} = {c}\n#### {c}",
                           "question": question}}


def splits(n_train: int = 4000, n_eval: int = 128, seed: int = 0, level: str = "mixed") -> dict[str, list[dict]]:
    """{"train": rows, "val": rows}: seeded draws, the held-out ones first; a training draw whose (story, numbers)
    is held out is skipped. ValueError when the held-out split would take half the level's distinct problems."""
    if level not in LEVELS:
        raise ValueError(f"level {level!r} is not one of {sorted(LEVELS)}")
    distinct = sum((ahi - alo + 1) * (bhi - blo + 1) * sum(op == o for o, _ in STORIES)
                   for op, ((alo, ahi), (blo, bhi)) in LEVELS[level].items())
    if 2 * n_eval > distinct:
        raise ValueError(f"--n-eval {n_eval}: level {level!r} has {distinct} distinct problems; hold out at most "
                         f"{distinct // 2}")
    rng = random.Random(f"arith:{seed}" if level == "mixed" else f"arith:{level}:{seed}")
    held, seen = [], set()
    while len(held) < n_eval:
        k = problem(rng, level)
        if k[:3] not in seen:
            seen.add(k[:3])
            held.append(k)
    train = []
    while len(train) < n_train:
        k = problem(rng, level)
        if k[:3] not in seen:
            train.append(k)
    return {"train": [to_row(k, "train", i) for i, k in enumerate(train)],
            "val": [to_row(k, "val", i) for i, k in enumerate(held)]}
