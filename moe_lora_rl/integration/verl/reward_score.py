"""The default reward's scorers: verl 0.9.1's `default_compute_score` (verl.utils.reward_score), with what it reads
wrong replaced:

- `openai/gsm8k` (gsm8k.py) reads only the last 300 characters: "2 + 40 = 42\\n#### 42" is paid 1.0 alone and 0.0
  once more than 300 characters follow it; "#### 42.0", "#### $42", "#### 42." are paid 0. Replaced by
  `gsm8k_score`.
- `math_dapo`, `math`, `math_dapo_reasoning`, `aime*` (math_dapo.py) read only the last 300 characters for the
  Minerva "Answer: X" line, and of those only the last 100 for the \\boxed{X} fallback; "42.0" is not 42.
  Replaced by `math_dapo_score`: verl's own extraction and normalisation on the whole response, then plain numbers
  compared as numbers.
- MATH (`lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`; math_reward.py) reads the
  whole response, but "\\boxed{1,234}" is not 1234 nor "\\boxed{42.0}" 42: `math_score` pays what verl's does, and
  a boxed plain number equal to a plain-number ground truth.

Every other source goes to verl's scorer unchanged (prime_math, geo3k, search-R1 and the code scorers read the whole
response). What each source reads, and the measured differences: docs/data.md.

    default_compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
"""
from __future__ import annotations

import re
from decimal import Decimal

from verl.utils.reward_score import default_compute_score as verl_default_compute_score

GSM8K_SOURCE = "openai/gsm8k"
MATH_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
"""With every source starting with "aime": the sources verl hands to math_dapo.compute_score."""
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
"""The sources verl hands to math_reward.compute_score."""

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?!\d|,\d)(?:\.\d+)?"
_GSM8K_ANSWER = re.compile(r"####[ \t]*\$?[ \t]*(" + _NUMBER + ")")
_PLAIN_NUMBER = re.compile(r"[ \t]*\$?[ \t]*(" + _NUMBER + r")[ \t]*")


def gsm8k_answer(solution_str: str) -> Decimal | None:
    """The number after the response's FIRST "####", or None when no "####" is followed by one.

    Read: the whole response (no length cut). The first marker, because gsm8k's answer format ends the solution
    with one "#### N" line (the dataset's own solutions do): what a model writes after it is not the answer to this
    question (often a new, made-up question with its own "####"); lm-evaluation-harness's gsm8k strict-match takes
    the first match too. Between "####" and the number: spaces or tabs and one "$". The number: an optional "-",
    digits with or without thousands commas ("1,234"), an optional decimal part ("42.0" is 42); a trailing "." ends
    it ("#### 42." is 42); a malformed grouping ("1,23") is no number."""
    m = _GSM8K_ANSWER.search(solution_str)
    return None if m is None else Decimal(m.group(1).replace(",", ""))


def gsm8k_truth(ground_truth) -> Decimal:
    """The ground truth as a number (a str or int: "42", "1,234", "-7", "42.0"); ValueError when it is not one."""
    m = _PLAIN_NUMBER.fullmatch(str(ground_truth))
    if m is None or isinstance(ground_truth, bool):
        raise ValueError(f"openai/gsm8k ground truth {ground_truth!r} is not a number: the row's "
                         "reward_model.ground_truth must be gsm8k's final answer (e.g. '42')")
    return Decimal(m.group(1).replace(",", ""))


def gsm8k_score(solution_str: str, ground_truth) -> float:
    """1.0 when gsm8k_answer(solution_str) equals the ground truth as a number, else 0.0 (verl's gsm8k scorer's
    values: no format score). ValueError for a ground truth that is not a number."""
    want = gsm8k_truth(ground_truth)
    got = gsm8k_answer(solution_str)
    return 1.0 if got is not None and got == want else 0.0


def plain_number(text) -> Decimal | None:
    """text as a number when it is one plain number (an optional "$" or "\\$", "-", thousands commas, a decimal
    part: "1,234", "-7", "42.0", "\\$42"), else None (an expression, a fraction, words)."""
    m = _PLAIN_NUMBER.fullmatch(str(text).replace("\\$", "$"))
    return None if m is None else Decimal(m.group(1).replace(",", ""))


def _same_number(a, b) -> bool:
    x, y = plain_number(a), plain_number(b)
    return x is not None and x == y


def math_dapo_score(solution_str: str, ground_truth: str) -> dict:
    """verl's math_dapo.compute_score (strict_box_verify off) on the whole response: the LAST Minerva
    "Answer: X" line (verl's is_correct_minerva and normalize_final_answer), else the LAST \\boxed{X} (verl's
    last_boxed_only_string) compared exactly; a prediction and ground truth that are plain numbers are compared as
    numbers. {"score": 1.0 or -1.0, "acc": bool, "pred": str}, as verl's."""
    from verl.utils.reward_score import math_dapo

    correct, pred = math_dapo.is_correct_minerva(solution_str, ground_truth)
    if pred == "[INVALID]":
        boxed = math_dapo.last_boxed_only_string(solution_str)
        if boxed is not None:
            pred = math_dapo.remove_boxed(boxed)
            correct = pred == ground_truth
    correct = bool(correct) or (pred != "[INVALID]" and _same_number(pred, ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def math_score(solution_str: str, ground_truth: str) -> float:
    """verl's math_reward.compute_score (the LAST \\boxed{X} of the whole response, lm-evaluation-harness's
    hendrycks_math normalisation), or 1.0 when that boxed answer and the ground truth are equal plain numbers."""
    from verl.utils.reward_score import math_reward

    if math_reward.compute_score(solution_str, ground_truth) == 1.0:
        return 1.0
    boxed = math_reward.last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = math_reward.remove_boxed(boxed)
    except AssertionError:              # verl's check of the box's form ("\\fbox", an unclosed brace)
        return 0.0
    return 1.0 if _same_number(answer, ground_truth) else 0.0


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl's default_compute_score with gsm8k_score for openai/gsm8k, math_dapo_score for verl's math_dapo
    sources and math_score for its MATH ones; any other source as verl scores it (NotImplementedError for one verl
    does not know)."""
    if data_source == GSM8K_SOURCE:
        return gsm8k_score(solution_str, ground_truth)
    if data_source in MATH_DAPO_SOURCES or data_source.startswith("aime"):
        return math_dapo_score(solution_str, ground_truth)
    if data_source in MATH_SOURCES:
        return math_score(solution_str, ground_truth)
    return verl_default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
