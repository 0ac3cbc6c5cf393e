"""The one loop (rl/run.py's GRPORun.loop) and the policies job's turns (rl/policies_run.py's PoliciesRun.loop) over a
scripted rollout source, one process, no engine: each step takes the source's groups, trains, pushes, tells the
source, and records (the evaluation with the source's version and recovery, the checkpoint with the source's state);
the source's last() comes before the last step's evaluation; a policy that fails stops alone, its source closed, and
a resumed policy takes its turns from its own first step."""
from __future__ import annotations

import contextlib
import types

from moe_lora_rl.rl.policies_run import PoliciesRun
from moe_lora_rl.rl.run import GRPORun
from moe_lora_rl.rl.source import Rollout, RolloutSource


class Script(RolloutSource):
    def __init__(self, run, calls):
        super().__init__(run)
        self.calls = calls

    def recover(self, i):
        pass

    def open(self):
        self.calls.append("open")

    def close(self):
        self.calls.append("close")

    def take(self, step):
        self.calls.append(("take", step))
        return Rollout([types.SimpleNamespace(prompt=[0], response=[1, 2], versions=[step])], [step], {"k": step})

    def pushed(self):
        self.calls.append("pushed")

    def last(self):
        self.calls.append("last")

    def eval_version(self):
        return 7

    def state(self):
        return {"groups_done": [1]}


class Fake(GRPORun):
    """The run's pieces scripted: every call is logged."""

    def __init__(self, calls, steps=3, fail_at=None, name="a"):
        self.cfg = types.SimpleNamespace(steps=steps, eval_every=2, checkpoint_every=2)
        self.calls, self.fail_at, self.owner = calls, fail_at, name
        self.served, self.policy = None, types.SimpleNamespace(version=0)
        self.t_rl, self.eval_s, self.eval_lens = 0.0, 0.0, []
        self.log = types.SimpleNamespace(log=lambda step, m: calls.append(("log", step)),
                                         note=lambda text: calls.append(("note", text)))

    def train(self, samples, plans):
        self.calls.append(("train", self.owner, plans[0]))
        return {"loss": float("nan") if plans[0] == self.fail_at else 0.5}, None, None

    def push(self, restarts=True, after_restart=None, engines=None):
        self.calls.append(("push", after_restart is not None))
        self.policy.version += 1
        return 10

    def evaluate(self, version=None, after_restart=None):
        self.calls.append(("eval", version, after_restart is not None))
        return 0.5

    def eval_sources(self):
        return {}

    def stepped(self, step):
        pass

    def save(self, step, history, evals, **extra):
        self.calls.append(("save", step, extra))


def test_one_loop_pulls_from_its_source_and_keeps_the_books_in_one_place():
    calls = []
    run = Fake(calls)
    history, evals = [], {}
    run.loop(Script(run, calls), 0, history, evals)
    step = lambda s: [("take", s), ("train", "a", s), ("push", True), "pushed"]      # noqa: E731
    assert calls == ["open", *step(0), ("log", 1), *step(1), ("eval", 7, True), ("log", 2), ("save", 2, {
        "groups_done": [1]}), *step(2), "last", ("eval", 7, True), ("log", 3), ("save", 3, {"groups_done": [1]}),
        "close"]
    assert [h["version"] for h in history] == [1, 2, 3] and [h["k"] for h in history] == [0, 1, 2]
    assert evals == {2: 0.5, 3: 0.5} and history[1]["eval"] == 0.5 and history[0]["refit_bytes"] == 10
    assert {"time_rollout_s", "time_train_s", "time_push_s", "samples_sha256", "rollout_versions"} <= history[0].keys()


def test_policies_take_turns_and_a_failing_one_stops_alone():
    calls = []
    job = PoliciesRun.__new__(PoliciesRun)
    job.cfg, job.failed = types.SimpleNamespace(steps=3), {}
    job.runs = [Fake(calls, name="a"), Fake(calls, fail_at=1, name="b"), Fake(calls, name="c")]
    job.start = {"a": 0, "b": 0, "c": 2}                   # c resumed at step 2
    for r in job.runs:
        r.job, r.source = job, Script(r, calls)
    job.sources = lambda opened: contextlib.nullcontext()
    opened = {r.owner: (job.start[r.owner], [], {}, {}) for r in job.runs}
    job.loop(opened)
    trained = [c[1:] for c in calls if c[0] == "train"]
    assert trained == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("c", 2)]
    assert list(job.failed) == ["b"] and job.failed["b"].startswith("step 2: non-finite loss")
    assert [len(opened[n][1]) for n in "abc"] == [3, 1, 1]
    assert calls.count("close") == 4 and calls.count("open") == 3        # b's source closed when it stopped


class Gen:
    """A policy's run as the shared sync sources see it (rank 0, an engine that returns the plans it is asked)."""

    def __init__(self, name, calls, job):
        self.owner, self.calls, self.job, self.rank, self.busy = name, calls, job, 0, {"rollout": 0.0}
        self.log = types.SimpleNamespace(note=lambda text: calls.append(("note", text)))
        self.prod = types.SimpleNamespace(generate=self.generate, kv_step=lambda: {}, submit=lambda out, labels: None,
                                          labels=lambda plans: (plans, None), release=lambda s: calls.append(
                                              ("release", self.owner, s)))

    def plans(self, step):
        return [step]

    def serving_version(self):
        return 0

    def generate(self, plans, keep, version=None):
        self.calls.append(("generate", self.owner, plans[0]))
        return [(self.owner, plans[0])]

    def _on_engine(self, what, fn, after_restart=None):
        return fn()


def test_turns_begin_the_next_policys_rollout_while_one_trains(monkeypatch):
    from moe_lora_rl.rl import source as source_mod
    from moe_lora_rl.rl.shared_sources import Turns

    monkeypatch.setattr(source_mod, "broadcast", lambda obj, src=0: obj)
    calls = []
    job = types.SimpleNamespace(rank=0, failed={})
    a, b = Gen("a", calls, job), Gen("b", calls, job)
    job.turns = lambda: [(0, a), (0, b), (1, a), (1, b)]
    with Turns(job) as turns:
        src = {r.owner: turns.source(r) for r in (a, b)}
        got = [src["a"].take(0).samples, src["b"].take(0).samples]
        turns.started[(1, "a")].result()                   # begun while b trains
        job.failed["a"] = "step 2: stopped"                # a stops (in its training) before its turn
        got += [src["b"].take(1).samples]
    assert got == [[("a", 0)], [("b", 0)], [("b", 1)]]
    # a's first step generated in its turn, each next turn's begun ahead once the one before it was in
    assert [c for c in calls if c[0] == "generate"] == [("generate", "a", 0), ("generate", "b", 0),
                                                        ("generate", "a", 1), ("generate", "b", 1)]
    assert ("release", "a", [("a", 1)]) in calls        # begun for a, which stopped before its turn: released
