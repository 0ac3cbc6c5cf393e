"""The synchronous rollout sources of several policies on one engine pool (rl/policies_run.py), each policy's step
generated with its own newest version:

    shared = Turns(job) | Batched(job)         # a context: the job's loop opens it before, closes it after its turns
    source = shared.source(policy_run)         # that policy's RolloutSource (rl/source.py)

Turns: each policy's step is generated in its turn, and while one policy trains rank 0 already generates the next
turn's step (another policy's: its version is final, it was pushed at the end of its own last turn, so each rollout
is on-policy as when the policies run alone); a generation begun ahead that fails is repeated in turn, with the
engines' recovery. Batched (policies_rollout=batched): every live policy's step in one engine batch, each request
pinned to its own policy's version (the requests of all policies share the engine's decode steps); if that batch
fails, each policy's step is generated alone, so a bad input stops its policy only.
"""
from __future__ import annotations

import time

from .source import Rollout, SyncSource


class _Shared:
    def __init__(self, job):
        self.job = job

    def source(self, run) -> "PolicySource":
        return PolicySource(run, self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class PolicySource(SyncSource):
    """One policy's step from the shared source (its take), generated alone when the shared one has none for it."""

    def __init__(self, run, shared: _Shared):
        super().__init__(run)
        self.shared = shared

    def take(self, step: int) -> Rollout:
        return self.shared.take(step, self)


class Turns(_Shared):
    def __init__(self, job):
        super().__init__(job)
        self.sources: dict = {}           # policy -> its source
        self.started: dict = {}           # (step, policy) -> rank 0's future of its generation (elsewhere: True)
        self.ahead = None

    def __enter__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.ahead = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if self.job.rank == 0 else None
        return self

    def source(self, run) -> PolicySource:
        self.sources[run.owner] = super().source(run)
        return self.sources[run.owner]

    def take(self, step: int, src: PolicySource) -> Rollout:
        """src's step (begun ahead, or now); once it is in, the next turn's is begun when it is another policy's
        (the same policy's next step would need this turn's version). Decided alike on every rank."""
        got = src.rollout(step, self.started.pop((step, src.run.owner), None))
        turns = self.job.turns()
        nxt = next((t for t in turns[turns.index((step, src.run)) + 1:] if t[1].owner not in self.job.failed), None)
        if nxt is not None and nxt[1] is not src.run:
            key = (nxt[0], nxt[1].owner)
            self.started[key] = True if self.ahead is None else \
                self.ahead.submit(self.sources[key[1]].generation(nxt[0], {}))
        return got

    def __exit__(self, *exc) -> None:
        if self.ahead is not None:
            self.ahead.shutdown(wait=True, cancel_futures=True)
            for (_, owner), fut in self.started.items():    # begun for a policy that stopped: never scored
                if not fut.cancelled() and fut.exception() is None:
                    self.sources[owner].run.prod.release(fut.result()[0])


class Batched(_Shared):
    def __init__(self, job):
        super().__init__(job)
        self.step, self.got = None, {}           # the step generated last, its Rollouts not taken yet

    def take(self, step: int, src: PolicySource) -> Rollout:
        """The first live policy to ask for `step` generates every live policy's; each takes its own."""
        if self.step != step:
            live = self.job.live(step)
            self.step, self.got = step, {}
            try:
                self.got = live[0]._on_engine(f"the batched rollout of step {step + 1}", self.batched(step, live))
            except (ValueError, RuntimeError) as e:        # every rank: each policy's step generated alone below
                live[0].log.note(f"the batched rollout of step {step + 1} failed ({' '.join(str(e).split())}); "
                                 "generating each policy's step alone")
        got = self.got.pop(src.run.owner, None)
        return src.rollout(step) if got is None else got

    def batched(self, step: int, live: list):
        """Rank 0: a function generating every live policy's groups of `step` in one engine call per engine, each
        request pinned to its own policy's version; {policy: Rollout}."""
        from ..rollout.replicas import gather, spread

        items = [(r, p) for r in live for p in r.plans(step)]
        version = {r.owner: r.serving_version() for r in live}
        g = self.job.cfg.algo.group_size
        engines = self.job.head.prod.engines
        keep: dict = {}

        def engine_part(i, engine, parts):
            prompts, seeds, versions = [], [], []
            for r, p in (items[k] for k in parts[i]):
                req = r.prod.requests([p])
                prompts += req["prompts"]
                seeds += req["seeds"]
                versions += [version[r.owner]] * len(req["prompts"])
            return engine.generate(prompts, seeds=seeds, versions=versions, **live[0].prod.sampling())

        def generate():                            # rank 0, the engines' side
            t0 = time.perf_counter()
            parts = spread(len(items), len(engines))
            done = engines.map(lambda i, e: engine_part(i, e, parts), [i for i, p in enumerate(parts) if p], keep)
            groups = gather(parts, {i: [s[j:j + g] for j in range(0, len(s), g)] for i, s in done.items()},
                            len(items))
            out = {}
            for (r, p), grp in zip(items, groups):
                out.setdefault(r.owner, Rollout([], []))
                out[r.owner].samples.extend(grp)
                out[r.owner].plans.append(p)
            for r in live:
                r.busy["rollout"] += (time.perf_counter() - t0) / len(live)
            return out

        return generate
