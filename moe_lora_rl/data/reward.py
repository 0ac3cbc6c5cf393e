"""The task's scorer, with verl's reward-function signature. Self-contained (no package imports), so verl can load
it as ``custom_reward_function.path`` either as ``pkg://moe_lora_rl.data.reward`` or by file path."""
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


_TRACE_LINE = re.compile(r" (\d) \|( \d)*")


def trace_result(text: str) -> list[int] | None:
    """The sorted list a written selection sort produces: each line's first digit, in order; None when a line is
    not `` m | d d ...`` (surrounding newlines ignored)."""
    out = []
    for line in text.strip("\n").split("\n"):
        m = _TRACE_LINE.fullmatch(line)
        if m is None:
            return None
        out.append(int(m.group(1)))
    return out


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 when the response is exactly the answer, else 0.0 (no partial credit): for DATA_SOURCE the spaced digits
    on the first line; for TRACE_SOURCE the whole written trace (surrounding blank space ignored); for LONG_SOURCE
    the final result the trace writes (trace_result: the picks, one per line, every line well formed) against the
    ground truth's, whatever the remainders written beside them."""
    if data_source == TRACE_SOURCE:
        return 1.0 if solution_str.strip("\n") == ground_truth else 0.0
    if data_source == LONG_SOURCE:
        want = trace_result(ground_truth)
        return 1.0 if want and trace_result(solution_str) == want else 0.0
    if data_source != DATA_SOURCE:
        raise ValueError(f"data_source {data_source!r} is not one of {(DATA_SOURCE, TRACE_SOURCE, LONG_SOURCE)}")
    return 1.0 if extract_answer(solution_str) == ground_truth else 0.0
