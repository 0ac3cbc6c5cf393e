"""verl 0.9.1's server against vLLM 0.32's AsyncLLM: the one call whose signature moved.

verl's `abort_all_requests` (every weight sync of its async trainers, and validation in them) calls
`pause_generation(wait_for_inflight_requests=False, clear_cache=...)`; vLLM 0.32 takes `mode="abort" | "wait" |
"keep"` instead and raises TypeError on the old keyword. Our server wraps its engine in `PauseCompat` when (and only
when) the engine's pause_generation lacks that keyword; every other attribute is the engine's own.
"""
from __future__ import annotations

import inspect


def needs_pause_compat(engine) -> bool:
    params = inspect.signature(engine.pause_generation).parameters
    return "wait_for_inflight_requests" not in params and "mode" in params


class PauseCompat:
    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def pause_generation(self, *, wait_for_inflight_requests: bool | None = None, **kwargs):
        if wait_for_inflight_requests is not None and "mode" not in kwargs:
            kwargs["mode"] = "wait" if wait_for_inflight_requests else "abort"
        return await self._engine.pause_generation(**kwargs)
