"""The mode factory: `mode` names the rollout source (sync: rl/source.py's SyncSource, async: rl/async_source.py's
AsyncSource) that the one loop (rl/run.py's GRPORun.loop) pulls from; a config with `policies` runs
rl/policies_run.py's PoliciesRun, its policies in turns, each from its own source of that mode.
It lives here, where the runs and every source are seen (policies_run builds on run, so run cannot name it back).

    summary = run_class(cfg)(cfg, world_size).run()
"""
from __future__ import annotations

from functools import partial

from .async_source import AsyncSource
from .config import MODES, TrainConfig
from .policies_run import PoliciesRun
from .run import GRPORun
from .source import SyncSource

SOURCES = {"sync": SyncSource, "async": AsyncSource}
assert set(SOURCES) == set(MODES), f"a mode without its rollout source: {sorted(set(MODES) ^ set(SOURCES))}"


def run_class(cfg: TrainConfig):
    """The run of cfg (TrainConfig has already refused any other mode): the policies job or a run of one policy,
    given its mode's rollout source; called as run_class(cfg)(cfg, world_size)."""
    return partial(PoliciesRun if cfg.policies else GRPORun, source=SOURCES[cfg.mode])
