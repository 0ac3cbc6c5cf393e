"""The task's scorer, with verl's reward-function signature. Self-contained (no package imports), so verl can load
it as ``custom_reward_function.path`` either as ``pkg://moe_lora_rl.rl.reward`` or by file path."""
from __future__ import annotations

import re

DATA_SOURCE = "moe_lora_rl/addition"
TRACE_SOURCE = "moe_lora_rl/sort_trace"
LONG_SOURCE = "moe_lora_rl/sort_long"

_ANSWER = re.compile(r"\d( \d)*")


def extract_answer(solution_str: str) -> str | None:
    """The response's first line, stripped, if it is digits separated by single spaces; else None."""
    line = solution_str.split("\n", 1)[0].strip()
    return line if _ANSWER.fullmatch(line) else None


def final_line(text: str) -> str:
    """The last non-blank line, stripped ('' for a blank text)."""
    lines = [ln.strip() for ln in text.strip().split("\n") if ln.strip()]
    return lines[-1] if lines else ""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 when the response is exactly the answer, else 0.0 (no partial credit): for DATA_SOURCE the spaced digits
    on the first line; for TRACE_SOURCE the whole written trace (surrounding blank space ignored); for LONG_SOURCE
    the final result, the response's last line ("= 1 1 3 4"), whatever the working above it."""
    if data_source == TRACE_SOURCE:
        return 1.0 if solution_str.strip("\n") == ground_truth else 0.0
    if data_source == LONG_SOURCE:
        want = final_line(ground_truth)
        return 1.0 if want.startswith("=") and final_line(solution_str) == want else 0.0
    if data_source != DATA_SOURCE:
        raise ValueError(f"data_source {data_source!r} is not one of {(DATA_SOURCE, TRACE_SOURCE, LONG_SOURCE)}")
    return 1.0 if extract_answer(solution_str) == ground_truth else 0.0
