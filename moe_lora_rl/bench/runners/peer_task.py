"""The task every peer of bench peers trains and the one evaluator scores (pure): its TaskSpec, the most response
tokens a peer samples, and our main job's overrides for it.

    spec, max_tokens, overrides = peer_task("sort_trace")
"""
from __future__ import annotations

from ...data.task import TaskSpec

TRACE_OVERRIDES = ("data.task=sort_trace", "data.length=10", "data.eval_samples=1", "algo.max_response_tokens=96")
"""The main job on the written selection sort of 10 digits (85-token answers, up to 96 sampled), every held-out
problem once per evaluation: also bench sparse's sort_trace setting."""

TASKS = {
    "sort": (TaskSpec(), 8, ()),
    "sort_trace": (TaskSpec(kind="sort_trace", length=10), 96, TRACE_OVERRIDES),
}
"""sort: the default task (5 digits, answers of 6 tokens); sort_trace: the written selection sort of 10 digits
(85-token answers), the long task of bench sparse. The evaluator's problems are the first n_eval of the task's
held-out lists (a prefix of the held-out set every peer's training split excludes)."""


def peer_task(name: str, n_eval: int | None = None) -> tuple[TaskSpec, int, list[str]]:
    """(TaskSpec, max response tokens, our main job's overrides); ValueError naming an unknown task."""
    if name not in TASKS:
        raise ValueError(f"--task={name!r}: choose one of {sorted(TASKS)}")
    spec, max_tokens, overrides = TASKS[name]
    if n_eval is not None:
        from dataclasses import replace

        spec = replace(spec, n_eval=n_eval)
    return spec, max_tokens, list(overrides)
