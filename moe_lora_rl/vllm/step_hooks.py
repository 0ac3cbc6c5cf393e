"""Listeners around each model forward of vLLM's model runner: the one place that wraps `_model_forward`.

    runner._model_forward (instance attribute, installed once per runner)
        info = StepInfo(request ids, query_start_loc, computed tokens)   read before the forward
        listener.before(info) for each listener
        the runner's own forward
        listener.after(info) for each listener, in reverse order, also when the forward raised (info.failed)

Routing capture (capture.py) splits each step's routes by request in `after`; the LoRA runtime (runtime.py) plans
which tokens run on which adapter version in `before` and drops the plan in `after`. Each registers and
unregisters itself, so stopping one never removes the other. The wrapper stays installed while it has no listener
(it then only calls the runner's forward). Forwards vLLM runs outside `_model_forward` (warm-up and dummy runs)
see no step: listeners treat them as untracked tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ATTR = "_moe_lora_step_hooks"


@dataclass
class StepInfo:
    req_ids: list[str]                 # vLLM's internal request ids of the step, in batch order
    query_start_loc: np.ndarray        # [num_reqs + 1] token offsets of each request in the flattened batch
    num_computed_tokens: np.ndarray    # [num_reqs] tokens each request had computed before this step
    failed: bool = False               # set before `after` when the forward raised

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def step_info(runner) -> StepInfo:
    num = runner.input_batch.num_reqs
    return StepInfo(list(runner.input_batch.req_ids[:num]), runner.query_start_loc.np[: num + 1].copy(),
                    runner.input_batch.num_computed_tokens_cpu[:num].copy())


class StepHooks:
    def __init__(self, runner):
        self.runner = runner
        self.listeners: list = []
        orig = runner._model_forward

        def forward(*args, **kwargs):
            if not self.listeners:
                return orig(*args, **kwargs)
            info = step_info(runner)
            listeners = list(self.listeners)
            done = []
            try:
                for listener in listeners:
                    listener.before(info)
                    done.append(listener)
                return orig(*args, **kwargs)
            except BaseException:
                info.failed = True
                raise
            finally:
                for listener in reversed(done):
                    listener.after(info)
        runner._model_forward = forward


def step_hooks(runner) -> StepHooks:
    """The runner's hooks, wrapping its `_model_forward` on first use."""
    hooks = runner.__dict__.get(_ATTR)
    if hooks is None:
        hooks = StepHooks(runner)
        setattr(runner, _ATTR, hooks)
    return hooks


def add_listener(runner, listener) -> None:
    hooks = step_hooks(runner)
    if listener not in hooks.listeners:
        hooks.listeners.append(listener)


def remove_listener(runner, listener) -> None:
    hooks = runner.__dict__.get(_ATTR)
    if hooks is not None and listener in hooks.listeners:
        hooks.listeners.remove(listener)
