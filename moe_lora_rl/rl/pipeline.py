"""The asynchronous producer, on rank 0: keeps the engine full with whole GRPO groups under the staleness gate
(rl/groups.py) while the trainer takes finished groups, P per update.

    pipe = Pipeline(producer, gate, plan_of=lambda g: group_plan(...), done=set_of_trained_or_dropped_groups)
    pipe.start()
    groups, dropped = pipe.take(P, trainer_version)   # finished groups (in finishing or admission order, `order`);
                                                      # over the bound: dropped
    pipe.serve(version)                               # after each in-flight push: the gate opens further
    pipe.recover(i)                                   # after engine i's restart: groups it lost are generated again
    pipe.stop()

One thread admits groups while the gate allows and hands each batch of admitted groups to streaming threads
(RolloutEngine.stream), each group to the engine replica with the fewest groups in flight: samples are filed under
their group as they finish, and a group is offered to the trainer only once all its samples are in. A group is never
trained on in part. order="admission" hands groups to the trainer in the order they were admitted: a finished group
waits until every group admitted before it is taken (a group is trained at the update it was admitted for, so none
is ever over the bound), and the trainer sees long and short answers in the proportion they are sampled; "finish"
hands over the first finished, so the first updates of a run see its shortest answers. When an engine dies, its
streaming threads fail; their unfinished groups are kept (already
admitted) and generated again, first, after recover(i); the other engines' streams go on.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from .groups import GroupPlan, StalenessGate


@dataclass
class FinishedGroup:
    plan: GroupPlan
    samples: list


class Pipeline:
    def __init__(self, producer, gate: StalenessGate, plan_of, done: set[int] = frozenset(), pin: bool = False,
                 order: str = "finish"):
        """pin: each request pinned to the version last served (gate.served) when it starts, instead of the
        engine's newest (several policies on one engine: the newest may be another policy's). order: finish or
        admission (the module's docstring)."""
        if order not in ("finish", "admission"):
            raise ValueError(f"order={order!r}: choose finish or admission")
        self.prod, self.gate, self.plan_of, self.pin, self.order = producer, gate, plan_of, pin, order
        self.done = set(done)                # trained on or dropped (a resumed run's included): never generated
        self.group_size = producer.cfg.algo.group_size
        self.cond = threading.Condition()
        self.next_g = 0
        self.retry: deque[GroupPlan] = deque()
        self.partial: dict[int, list] = {}
        self.plans: dict[int, GroupPlan] = {}
        self.finished: deque[FinishedGroup] = deque()
        self.error: BaseException | None = None
        self.stopping = False
        self.streams: list[tuple[int, threading.Thread]] = []      # (engine, its thread)
        self.load = [0] * len(producer.engines)                       # groups in flight per engine
        self.produced_tokens = self.produced_samples = 0
        self.wait_s = 0.0                    # trainer seconds spent waiting in take()
        self._thread = threading.Thread(target=self._admit_loop, name="producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- producer side ------------------------------------------------------------------------------------------
    def _next_plan(self) -> GroupPlan:
        while self.next_g in self.done:
            self.next_g += 1
        plan = self.plan_of(self.next_g)
        self.next_g += 1
        return plan

    def _admit_loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stopping or (self.error is None and
                                                             (self.retry or self.gate.may_admit())))
                if self.stopping:
                    return
                plans = list(self.retry)
                self.retry.clear()
                while self.gate.may_admit():
                    self.gate.admit()
                    plans.append(self._next_plan())
                per: dict[int, list[GroupPlan]] = {}
                for p in plans:
                    self.partial[p.index] = [None] * self.group_size
                    self.plans[p.index] = p
                    e = min(range(len(self.load)), key=lambda j: (self.load[j], j))
                    self.load[e] += 1
                    per.setdefault(e, []).append(p)
                started = [(e, threading.Thread(target=self._stream, args=(e, ps), name=f"producer-stream-{e}",
                                                daemon=True)) for e, ps in per.items()]
                self.streams = [(e, t) for e, t in self.streams if t.is_alive()] + started
            for _, t in started:
                t.start()

    def _stream(self, e: int, plans: list[GroupPlan]) -> None:
        g = self.group_size
        try:
            engine = self.prod.engines[e]
            req = self.prod.requests(plans)
            if self.pin:
                with self.cond:
                    req["versions"] = [self.gate.served] * len(req["prompts"])
            for i, sample in engine.stream(**req, **self.prod.sampling()):
                plan = plans[i // g]
                with self.cond:
                    if self.stopping:
                        return
                    slots = self.partial[plan.index]
                    slots[i % g] = sample
                    self.produced_tokens += len(sample.response)
                    self.produced_samples += 1
                    self.prod.submit_sample(sample, plan)       # its reward starts now, in the reward workers
                    if all(s is not None for s in slots):
                        del self.partial[plan.index]
                        self.load[e] -= 1
                        self.finished.append(FinishedGroup(self.plans.pop(plan.index), slots))
                        self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the trainer thread, which decides
            with self.cond:
                if self.stopping:
                    return
                for p in plans:                      # unfinished groups: generated again after recover()
                    slots = self.partial.pop(p.index, None)
                    if slots is not None:
                        self.prod.release(slots)     # the samples it had: generated again, their calls go
                        self.plans.pop(p.index, None)
                        self.retry.append(p)
                        self.load[e] -= 1
                if self.error is None:
                    self.error = _on_engine(e, err)
                self.cond.notify_all()

    # -- trainer side -------------------------------------------------------------------------------------------
    def take(self, n: int, trainer_version: int) -> tuple[list[FinishedGroup], list[FinishedGroup]]:
        """n finished groups, in finishing order, whose every sample is within the bound (in pushes, the gate's
        clock) at trainer_version; the
        groups found over it on the way are dropped (returned second, their places freed). The producer's error
        (e.g. EngineDied) is raised here."""
        t0 = time.perf_counter()
        ok, dropped = [], []
        try:
            with self.cond:
                while len(ok) < n:
                    self.cond.wait_for(lambda: self._ready() is not None or self.error is not None)
                    if self.error is not None:
                        for grp in reversed(ok):          # not consumed: offered again after recover()
                            self.finished.appendleft(grp)
                        raise self.error
                    grp = self._ready()
                    self.finished.remove(grp)
                    worst = max(self.gate.staleness(trainer_version, s.versions) for s in grp.samples)
                    if worst > self.gate.k:
                        dropped.append(grp)
                        self.prod.release(grp.samples)    # never scored: its reward calls go
                        self.done.add(grp.plan.index)
                        self.gate.dropped()
                        self.cond.notify_all()
                    else:
                        ok.append(grp)
                for grp in ok:
                    self.done.add(grp.plan.index)
        finally:
            self.wait_s += time.perf_counter() - t0
        return ok, dropped

    def _ready(self) -> FinishedGroup | None:
        """The finished group to take next, or None: the first finished; with order="admission" the oldest admitted
        group, once it has finished (under the lock)."""
        if not self.finished:
            return None
        if self.order == "finish":
            return self.finished[0]
        grp = min(self.finished, key=lambda f: f.plan.index)
        pending = [p.index for p in self.retry] + list(self.partial)
        return grp if not pending or grp.plan.index < min(pending) else None

    def serve(self, version: int) -> None:
        with self.cond:
            self.gate.serve(version)
            self.cond.notify_all()

    def recover(self, engine: int, timeout: float = 60.0) -> None:
        """Engine `engine` was restarted (and the current version pushed): once every stream to it has ended (and
        filed its unfinished groups), generate the lost groups again."""
        with self.cond:
            old = [t for e, t in self.streams if e == engine]
        for t in old:
            t.join(timeout)
        with self.cond:
            self.error = None
            self.cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """No more groups; streams end at their next sample (the engine aborts what a closed stream left)."""
        with self.cond:
            self.stopping = True             # no stream files (or submits) a sample after this
            for slots in self.partial.values():
                self.prod.release(slots)
            for grp in self.finished:        # finished and never taken
                self.prod.release(grp.samples)
            self.cond.notify_all()
        self._thread.join(timeout)
        for _, t in self.streams:
            t.join(timeout)

    def in_flight(self) -> int:
        """Groups admitted and not yet finished."""
        with self.cond:
            return len(self.partial) + len(self.retry)


def _on_engine(e: int, err: BaseException) -> BaseException:
    """A dead engine's error names its replica (rl/run.py restarts only that one)."""
    from ..rollout.client import EngineDied
    from ..rollout.replicas import ReplicaDied

    return ReplicaDied(e, err) if isinstance(err, EngineDied) and not isinstance(err, ReplicaDied) else err
