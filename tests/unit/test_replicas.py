"""Engine replicas (rollout/replicas.py, placement.plan_placements): groups spread whole and gathered back in order,
a push fanned out to every engine with one version, a dead engine named by its index with the others' results
kept, and the placements of N engines (hosts round robin, devices split) with their refusals."""
import pytest

from moe_lora_rl.rl import config
from moe_lora_rl.rollout.client import EngineDied
from moe_lora_rl.rollout.placement import plan_placements
from moe_lora_rl.rollout.replicas import FanOut, ReplicaDied, Replicas, gather, spread


def test_spread_and_gather_keep_the_order():
    parts = spread(5, 2)
    assert parts == [[0, 2, 4], [1, 3]]
    assert gather(parts, {0: ["a", "c", "e"], 1: ["b", "d"]}, 5) == list("abcde")
    assert spread(2, 3) == [[0], [1], []]
    with pytest.raises(ValueError, match="n_engines=0"):
        spread(4, 0)


class FakeEngine:
    def __init__(self, name, die=False):
        self.name, self.die, self.calls = name, die, 0

    def work(self):
        self.calls += 1
        if self.die:
            self.die = False
            raise EngineDied(f"{self.name} exited with code -9")
        return self.name


def test_replica_died_travels_to_other_ranks():
    """A push's begin failure is broadcast to every rank (pickled): it must arrive whole, index included."""
    import pickle

    e = pickle.loads(pickle.dumps(ReplicaDied(1, EngineDied("exited with code -9"))))
    assert isinstance(e, ReplicaDied) and isinstance(e, EngineDied) and e.index == 1
    assert str(e) == "engine 1: exited with code -9"


def test_map_keeps_finished_engines_and_names_the_dead_one():
    engines = Replicas([FakeEngine("e0"), FakeEngine("e1", die=True), FakeEngine("e2")])
    keep = {}
    with pytest.raises(ReplicaDied, match="engine 1: e1 exited") as got:
        engines.map(lambda i, e: e.work(), range(3), keep)
    assert got.value.index == 1 and isinstance(got.value, EngineDied)
    assert keep == {0: "e0", 2: "e2"}
    assert engines.map(lambda i, e: e.work(), range(3), keep) == {0: "e0", 1: "e1", 2: "e2"}
    assert [e.calls for e in engines] == [1, 2, 1]          # the repeat ran only on the engine that died
    with pytest.raises(KeyError):                           # other errors are raised as they are
        engines.map(lambda i, e: {}["x"], [0], {})


class FakeTransport:
    def __init__(self, served=None, die_at=None):
        self.served, self.die_at, self.log = served, die_at, []

    def call(self, method, *args):
        self.log.append(method)
        if method == self.die_at:
            raise EngineDied("gone")
        if method == "moe_lora_commit":
            return {"version": args[0] if self.served is None else self.served}
        return {}

    def send_bucket(self, version, index, tensors):
        self.log.append(("bucket", index))

    def reset_prefix_cache(self):
        self.log.append("reset")


def test_fan_out_sends_everything_to_every_engine():
    a, b = FakeTransport(), FakeTransport()
    fo = FanOut([(0, a), (1, b)])
    fo.call("moe_lora_begin", 3, None, 8, 16.0, 2)
    fo.send_bucket(3, 0, {})
    fo.send_bucket(3, 1, {})
    assert fo.call("moe_lora_commit", 3, "d") == {"version": 3}
    fo.reset_prefix_cache()
    assert a.log == b.log == ["moe_lora_begin", ("bucket", 0), ("bucket", 1), "moe_lora_commit", "reset"]


def test_fan_out_refuses_engines_at_different_versions_and_names_a_dead_one():
    fo = FanOut([(0, FakeTransport()), (1, FakeTransport(served=2))])
    with pytest.raises(RuntimeError, match=r"version 3 committed, but the engines serve \{0: 3, 1: 2\}"):
        fo.call("moe_lora_commit", 3, "d")
    fo = FanOut([(0, FakeTransport()), (4, FakeTransport(die_at="moe_lora_begin"))])
    with pytest.raises(ReplicaDied, match="engine 4") as got:
        fo.call("moe_lora_begin", 3, None, 8, 16.0, 1)
    assert got.value.index == 4
    with pytest.raises(ValueError, match="at least one"):
        FanOut([])


def test_placements_of_replicas():
    same = plan_placements(2, nodes=None, gpus=[], this_host="h")
    assert [p.transport for p in same] == ["shm", "shm"] and same[0] == same[1]
    split = plan_placements(2, nodes=None, gpus=[0, 1, 2, 3], this_host="h")
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in split] == ["0,1", "2,3"]
    spread_over = plan_placements(3, nodes=["n1", "n2"], gpus=[0, 1], this_host="h")
    assert [p.connect_host for p in spread_over] == ["n1", "n2", "n1"]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in spread_over] == ["0", "0,1", "1"]   # n1 has two engines
    with pytest.raises(ValueError, match=r"rollout.gpus=\[0, 1, 2\]: 3 devices do not split evenly over the 2"):
        plan_placements(2, nodes=None, gpus=[0, 1, 2], this_host="h")
    with pytest.raises(ValueError, match="rollout.engines=0 must be an integer >= 1"):
        plan_placements(0, nodes=None, gpus=[], this_host="h")


def test_config_refuses_bad_replicas_and_timeouts():
    assert config.load(["rollout.engines=2"]).rollout.engines == 2
    assert config.load(["rollout.node=[n1,n2]", "rollout.engines=2"]).rollout.node == ["n1", "n2"]
    for bad, msg in ((["rollout.engines=0"], "rollout.engines=0"),
                     (["rollout.engines=2", "rollout.gpus=[0,1,2]"], "do not split evenly"),
                     (["rollout.stage_timeout_s=0"], "rollout.stage_timeout_s=0"),
                     (["rollout.stage_timeout_s=-5"], "rollout.stage_timeout_s=-5")):
        with pytest.raises(ValueError, match=msg):
            config.load(bad)
