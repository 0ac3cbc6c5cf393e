"""The async producer's pure parts and its threads against a scripted engine: the staleness gate (back-pressure at
exactly max_staleness updates ahead), whole groups only, groups over the bound dropped and replaced, an engine
failure handed to the trainer and the lost groups generated again after recover(); every sample's reward call is
collected or, for a sample never trained on (dropped, lost, left at stop), released (rl/producer.py's pending
entries)."""
import threading
from types import SimpleNamespace

import pytest

from moe_lora_rl.rl.groups import StalenessGate, group_plan, staleness
from moe_lora_rl.rl.pipeline import Pipeline
from moe_lora_rl.rl.schedule import prompt_indices, sample_seed


def test_group_plan_is_the_sync_order():
    for step in (0, 3):
        idx = prompt_indices(40, 4, step, 7)
        plans = [group_plan(40, 4, 3, 7, g) for g in range(step * 4, step * 4 + 4)]
        assert [p.problem for p in plans] == idx and all(p.step == step for p in plans)
        assert [list(p.seeds) for p in plans] == [[sample_seed(7, step, i, j) for j in range(3)] for i in idx]


def test_gate_admits_exactly_max_staleness_updates_ahead():
    gate = StalenessGate(prompts_per_step=2, max_staleness=1, version=5)
    planned = [gate.admit() for _ in range(4)]                 # updates 0 and 1 from the loop's start
    assert planned == [0, 0, 1, 1] and not gate.may_admit() and gate.ahead_max == 1
    with pytest.raises(RuntimeError, match="past the bound"):
        gate.admit()
    gate.dropped()                                             # a dropped group frees its place
    assert gate.may_admit() and gate.admit() == 1 and not gate.may_admit()
    gate.serve(6)
    assert [gate.admit(), gate.admit()] == [2, 2] and not gate.may_admit() and gate.ahead_max == 1
    with pytest.raises(ValueError, match="went back from 6 to 5"):
        gate.serve(5)
    with pytest.raises(ValueError, match="max_staleness=0"):
        StalenessGate(2, 0, 0)
    assert staleness(3, [None, None, 1]) == 3 and staleness(3, [2, 3]) == 1
    with pytest.raises(ValueError, match="without token versions"):
        staleness(1, [])


class ScriptedEngine:
    """stream(): one sample per request, in reverse order, versions from `version_of(seed)`; fails after `fail_after`
    samples once if set."""

    def __init__(self, version_of, fail_after=None):
        self.version_of, self.fail_after, self.calls = version_of, fail_after, []
        self.lock = threading.Lock()

    def stream(self, prompts, seeds, **kw):
        with self.lock:
            self.calls.append(list(seeds))
            fail, self.fail_after = self.fail_after, None
        for n, i in enumerate(reversed(range(len(prompts)))):
            if fail is not None and n == fail:
                raise RuntimeError("engine died")
            yield i, SimpleNamespace(seed=seeds[i], response=[1, 2], versions=[self.version_of(seeds[i])] * 2)


class InlineRewarder:
    """data/rewards.RewardWorkers' submit/collect without worker processes: a call's score is its response's length."""

    def submit(self, items):
        return [float(len(text)) for _, text in items]

    def collect(self, handle):
        return list(handle), [{} for _ in handle]

    def drop(self, calls):
        self.dropped = getattr(self, "dropped", 0) + len(calls)

    def close(self, kill=False):
        pass


def producer(engine, g=2, more=()):
    """rl/producer.Producer's own reward bookkeeping (submit, score, release) around scripted engines."""
    from moe_lora_rl.rl.producer import Producer

    cfg = SimpleNamespace(algo=SimpleNamespace(group_size=g),
                          reward=SimpleNamespace(path=None, name="compute_score", timeout_s=1.0, workers=1))
    tok = SimpleNamespace(decode=lambda ids, **kw: "x" * len(ids))
    prod = Producer(cfg, tok, "unused", [SimpleNamespace(data_source="t", index=i) for i in range(100)], [], "unused")
    prod.rewarder = InlineRewarder()
    prod.engines = [engine, *more]
    prod.requests = lambda plans: {"prompts": [[1]] * (g * len(plans)), "seeds": [s for p in plans for s in p.seeds]}
    prod.sampling = lambda: {}
    return prod


def scored(prod, groups):
    """The trainer's side: the taken groups' rewards collected (their entries leave the producer)."""
    samples = [s for grp in groups for s in grp.samples]
    return prod.score(samples, [prod.train_problems[grp.plan.problem] for grp in groups for _ in grp.samples])[0]


def plan_of(g):
    return SimpleNamespace(index=g, problem=g, seeds=(10 * g, 10 * g + 1))


def wait_idle(pipe, admitted):
    """Until the producer has admitted `admitted` groups and they all finished."""
    import time

    t0 = time.time()
    while (pipe.gate.admitted != admitted or pipe.in_flight()) and time.time() - t0 < 10:
        time.sleep(0.01)


def test_whole_groups_bound_and_drops():
    # the version each group was generated with: groups 0-3 admitted at version 1, 4-5 at 2 (group 4 comes back at
    # version 0, as if it had been stuck), 6 and later at 3
    eng = ScriptedEngine(lambda seed: {0: 1, 1: 1, 2: 1, 3: 1, 4: 0, 5: 2}.get(seed // 10, 3))
    gate = StalenessGate(prompts_per_step=2, max_staleness=1, version=1)
    prod = producer(eng)
    pipe = Pipeline(prod, gate, plan_of)
    pipe.start()
    try:
        ok, dropped = pipe.take(2, trainer_version=1)
        assert scored(prod, ok) == [2.0] * 4                                    # the calls started as samples came
        assert [g.plan.index for g in ok] == [3, 2] and not dropped            # in finishing order
        assert all(len(g.samples) == 2 for g in ok)
        assert {s.seed for g in ok for s in g.samples} == {30, 31, 20, 21}
        wait_idle(pipe, 4)
        assert pipe.in_flight() == 0 and gate.admitted == 4 and not gate.may_admit()   # held: 2 updates' worth
        pipe.serve(2)
        wait_idle(pipe, 6)
        ok, dropped = pipe.take(2, trainer_version=2)
        assert [g.plan.index for g in ok] == [1, 0] and not dropped
        scored(prod, ok)
        pipe.serve(3)
        ok, dropped = pipe.take(2, trainer_version=3)    # group 4 (version 0) is 3 versions old: dropped
        assert [g.plan.index for g in dropped] == [4] and ok[0].plan.index == 5 and len(ok) == 2, \
            ([g.plan.index for g in ok], [[s.versions for s in g.samples] for g in ok])
        assert all(staleness(3, s.versions) <= 1 for g in ok for s in g.samples)
        assert 4 in pipe.done and gate.ahead_max == 1
        assert prod.release(dropped[0].samples) == 0     # the dropped group's calls went with it
        scored(prod, ok)
    finally:
        pipe.stop()
    assert prod.pending() == 0        # every call collected or released: none dropped, in flight or left at stop


def test_admission_order_takes_the_oldest_admitted_groups_first():
    """order="admission": the engine finishes groups in reverse (3, 2, 1, 0), the trainer still gets 0 and 1, then
    2 and 3; "finish" (the control, the same engine) gets 3 and 2 first."""
    for order, first, second in (("admission", [0, 1], [2, 3]), ("finish", [3, 2], [1, 0])):
        pipe = Pipeline(producer(ScriptedEngine(lambda seed: 1)), StalenessGate(2, 1, version=1), plan_of,
                        order=order)
        pipe.start()
        try:
            ok, dropped = pipe.take(2, trainer_version=1)
            assert [g.plan.index for g in ok] == first and not dropped, order
            assert all(len(g.samples) == 2 for g in ok)
            ok, _ = pipe.take(2, trainer_version=1)
            assert [g.plan.index for g in ok] == second, order
        finally:
            pipe.stop()
    with pytest.raises(ValueError, match="order='oldest'"):
        Pipeline(producer(ScriptedEngine(lambda seed: 1)), StalenessGate(2, 1, version=1), plan_of, order="oldest")


def test_failure_reaches_the_trainer_and_lost_groups_come_back():
    eng = ScriptedEngine(lambda seed: 1, fail_after=1)  # the first stream dies after one sample
    prod = producer(eng)
    pipe = Pipeline(prod, StalenessGate(2, 1, version=1), plan_of)
    pipe.start()
    try:
        with pytest.raises(RuntimeError, match="engine died"):
            while True:
                pipe.take(1, trainer_version=1)
        assert prod.pending() == 0              # the one sample filed before the death: generated again, released
        pipe.recover(0)
        ok = []
        while len(ok) < 4:
            ok += pipe.take(1, trainer_version=1)[0]
        assert sorted(g.plan.index for g in ok) == [0, 1, 2, 3]     # every admitted group, whole
        assert all(len(g.samples) == 2 and None not in g.samples for g in ok)
        assert eng.calls[1] == eng.calls[0]                        # the lost groups resubmitted as they were
        assert prod.pending() == 8 and scored(prod, ok) == [2.0] * 8 and prod.pending() == 0
    finally:
        pipe.stop()


def test_replicas_share_groups_and_one_engine_dies_alone():
    from moe_lora_rl.rollout.client import EngineDied
    from moe_lora_rl.rollout.replicas import ReplicaDied

    class Dying(ScriptedEngine):
        def stream(self, prompts, seeds, **kw):
            for n, item in enumerate(super().stream(prompts, seeds, **kw)):
                if self.die and n == 1:
                    self.die = False
                    raise EngineDied("engine 1 was killed")
                yield item

    a, b = ScriptedEngine(lambda seed: 1), Dying(lambda seed: 1)
    b.die = True
    prod = producer(a, more=[b])
    pipe = Pipeline(prod, StalenessGate(2, 1, version=1), plan_of)
    pipe.start()
    try:
        ok = []                                   # engine 0's groups may be taken before the failure is seen
        with pytest.raises(ReplicaDied, match="engine 1: engine 1 was killed") as got:
            while True:
                ok += pipe.take(1, trainer_version=1)[0]
        assert got.value.index == 1
        pipe.recover(1)
        while len(ok) < 4:
            ok += pipe.take(1, trainer_version=1)[0]
        assert sorted(g.plan.index for g in ok) == [0, 1, 2, 3]
        assert a.calls[0] == [0, 1, 20, 21] and b.calls[0] == [10, 11, 30, 31]   # least loaded: groups alternate
        again = sorted(s for c in a.calls[1:] + b.calls[1:] for s in c)
        assert again == [10, 11, 30, 31]              # only the dead engine's groups, whole, spread again
        scored(prod, ok)
    finally:
        pipe.stop()
    assert prod.pending() == 0                        # the dead engine's filed sample released, none left at stop
