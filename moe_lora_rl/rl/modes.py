"""The mode factory: `mode` names the loop (sync: rl/run.py's GRPORun, async: rl/async_run.py's AsyncGRPORun);
a config with `policies` runs rl/policies_run.py's PoliciesRun, its policies in turns.
It lives here, where both loops are seen: async_run builds on run, so run cannot name async_run back.

    summary = run_class(cfg)(cfg, world_size).run()
"""
from __future__ import annotations

from .async_run import AsyncGRPORun
from .config import MODES, TrainConfig
from .policies_run import PoliciesRun
from .run import GRPORun

RUNS = {"sync": GRPORun, "async": AsyncGRPORun}
assert set(RUNS) == set(MODES), f"a mode without its loop: {sorted(set(MODES) ^ set(RUNS))}"


def run_class(cfg: TrainConfig) -> type[GRPORun] | type[PoliciesRun]:
    """The loop class of cfg.mode (TrainConfig has already refused any other mode), or the policies job."""
    return PoliciesRun if cfg.policies else RUNS[cfg.mode]
