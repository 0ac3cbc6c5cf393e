"""Where a step's groups come from: the rollout source the one loop (rl/run.py's GRPORun.loop) pulls from. Every mode
is the same loop over another source:

    with source:                                   # open: an async source starts its producer
        got = source.take(step)                    # the step's whole groups (samples, plans) on every rank
        ...train on them, push the new version...  # push(after_restart=source.recover)
        source.pushed()                            # the engines serve it: an async gate opens further
        m = {**source.figures(got, batch, proximal), ...}
        source.last()                              # before the last step's evaluation: production stops
        evaluate(source.eval_version(), after_restart=source.recover); save(..., **source.state())

Here the base (each hook's default) and mode=sync's source: generate now, with the adapter just pushed.
mode=async's is rl/async_source.py (the producer's threads under the staleness gate); several policies on one
engine take turns with rl/shared_sources.py's. A source reads the run it feeds (its cfg, rank, prod, plans,
engine recovery) and keeps its own state; the run keeps the bookkeeping of a step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .recovery import broadcast


@dataclass
class Rollout:
    """A step's groups as the loop trains on them (every rank): the samples, their GroupPlans, and what the source
    reports of them (its figures' input)."""
    samples: list
    plans: list
    info: dict = field(default_factory=dict)


class RolloutSource:
    """The hooks the loop calls (the module's docstring); the defaults: nothing to open, close or report."""

    recover = None                    # after_restart(i): rank 0, once restarted engine i serves the current version

    def __init__(self, run, state: dict | None = None):
        self.run = run

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def take(self, step: int) -> Rollout:
        raise NotImplementedError

    def pushed(self) -> None:
        """The engines serve the version just pushed."""

    def figures(self, got: Rollout, batch, proximal) -> dict:
        """The step's figures of this source (after the update and its push)."""
        return got.info

    def last(self) -> None:
        """Before the last step's evaluation."""

    def eval_version(self) -> int | None:
        """The version evaluation requests are pinned to (None: the run's serving version)."""
        return None

    def state(self) -> dict:
        """What a checkpoint keeps of this source (collective)."""
        return {}

    def summary(self, history: list[dict]) -> dict:
        return {}


class SyncSource(RolloutSource):
    """mode=sync: each step's groups generated when the loop asks, with the version the last step pushed; the
    engines' KV figures reported with them."""

    def take(self, step: int) -> Rollout:
        return self.rollout(step)

    def rollout(self, step: int, started=None) -> Rollout:
        """The step's samples on every rank. started (given on every rank or on none): a generation begun earlier
        (rl/shared_sources.py: while another policy trained), rank 0's future of it (any other rank: True); if it
        failed, the rollout runs again here, with the engines' recovery."""
        run, plans = self.run, self.run.plans(step)
        if started is not None:
            res = None
            if run.rank == 0:
                try:
                    res = ("ok", started.result())
                except Exception as e:  # noqa: BLE001 - every rank must learn it; the rollout is repeated below
                    res = ("again", f"{type(e).__name__}: {e}")
            kind, value = broadcast(res)
            if kind == "ok":
                return Rollout(value[0], plans, value[1])
            run.log.note(f"the rollout of step {step + 1} begun ahead failed ({value}); generating it again")
        samples, kv = run._on_engine(f"the rollout of step {step + 1}", self.generation(step, {}))
        return Rollout(samples, plans, kv)

    def generation(self, step: int, keep: dict | None = None):
        """Rank 0: a function generating the step's groups (with the version requests are pinned to, read now)
        and the engines' KV figures; keep: the finished engines' groups, kept if another engine dies."""
        run = self.run
        plans, version = run.plans(step), run.serving_version()

        def generate():
            t0 = time.perf_counter()
            out = run.prod.generate(plans, keep, version=version)
            kv = run.prod.kv_step()       # first: nothing may raise once the rewards are submitted (a lost
            #                               rollout's calls would stay pending)
            run.prod.submit(out, run.prod.labels(plans)[0])       # rewards start now, in the reward workers
            run.busy["rollout"] += time.perf_counter() - t0
            return out, kv
        return generate
