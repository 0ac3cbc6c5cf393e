"""The run config's `policies` (rl/config/policy_settings.py), without a model: each policy's own run config (the one it
would be trained with alone), and every bad list refused with one line naming the value."""
import pytest

from moe_lora_rl.rl.config import load
from moe_lora_rl.rl.config.policy_settings import module_lora, policy_configs

TWO = "policies=[{name: a, seed: 1}, {name: b, seed: 2, lr: 3e-3, alpha: 4, task: sort_trace, length: 9}]"


def test_each_policy_is_the_run_with_its_settings():
    cfg = load([TWO, "out_dir=/tmp/job", "algo.lr=1e-3"])
    (na, a), (nb, b) = policy_configs(cfg)
    assert (na, a.seed, a.algo.lr, a.lora.alpha, a.data.task, a.out_dir) == ("a", 1, 1e-3, 16.0, "sort", "/tmp/job/a")
    assert (nb, b.seed, b.algo.lr, b.lora.alpha, b.data.task, b.data.length) == ("b", 2, 3e-3, 4.0, "sort_trace", 9)
    assert a.policies == [] and b.out_dir == "/tmp/job/b" and a.lora.rank == b.lora.rank == cfg.lora.rank
    assert policy_configs(load([])) == []


def test_the_base_adapters_hold_every_policys_rank_and_targets():
    """Each policy keeps its own rank and targets; the shared base's modules take the largest rank and every
    policy's targets (in order of first appearance); without policies they are lora's."""
    cfg = load(["policies=[{name: a, rank: 4, targets: [experts]}, {name: b, rank: 16, targets: [attention, "
                "dense_mlp]}, {name: c}]"])
    own = {n: (p.lora.rank, p.lora.targets) for n, p in policy_configs(cfg)}
    assert own == {"a": (4, ["experts"]), "b": (16, ["attention", "dense_mlp"]), "c": (8, ["experts", "attention"])}
    m = module_lora(cfg)
    assert (m.rank, m.targets, m.alpha) == (16, ["experts", "attention", "dense_mlp"], cfg.lora.alpha)
    assert module_lora(load(["lora.rank=4"])).rank == 4


@pytest.mark.parametrize("override,match", [
    ("policies=[{name: a}, {name: a}]", "policies: name 'a' is given 2 times"),
    ("policies=[{name: 'a/b'}]", "policies: name='a/b' must be 1-64 letters"),
    ("policies=[{seed: 1}]", "policies: name='' must be"),
    ("policies=[{name: a, rank: 0}]", "policies: 'a': LoRA rank must be a positive integer, got rank=0"),
    ("policies=[{name: a, targets: [nonsense]}]", "policies: 'a': unknown LoRA targets \\['nonsense'\\]"),
    ("policies=[{name: a, targets: []}]", "policies: 'a': LoRA targets is empty"),
    ("policies=[{name: a, colour: red}]", "unknown config key"),
    ("policies=[{name: a, lr: -1}]", "policies: 'a': algo.lr=-1.0 must be >= 0"),
    ("policies=[{name: a, lr: inf}]", "policies: 'a': algo.lr=inf must be finite"),
    ("policies=[{name: a, task: sort_trace}]", "policies: 'a': task length=5 is outside 8..12"),
    ("policies=[{name: a}, {name: b}, {name: c}, {name: d}, {name: e}]",
     "policies: 5 policies need 5 adapter slots in the engine at once, rollout.max_versions=4"),
])
def test_bad_policies_named(override, match):
    with pytest.raises(ValueError, match=match) as e:
        load([override])
    assert "\n" not in str(e.value)


def test_policies_take_turns():
    with pytest.raises(ValueError, match="policies with mode=async and inflight=switch: .* set inflight=pin"):
        load(["policies=[{name: a}]", "mode=async"])
    with pytest.raises(ValueError, match="policies: 2 policies need 6 adapter slots in the engine at once, "
                                         "rollout.max_versions=4"):
        load(["policies=[{name: a}, {name: b, max_staleness: 1}]", "mode=async", "inflight=pin", "max_staleness=3"])
    cfg = load(["policies=[{name: a}, {name: b, max_staleness: 1}]", "mode=async", "inflight=pin"])
    assert [p.max_staleness for _, p in policy_configs(cfg)] == [1, 1]
    load(["policies=[{name: a}, {name: b}, {name: c}, {name: d}, {name: e}]", "rollout.max_versions=5"])
