"""Several policies on one base (policy/bank.py), in one process (world size 1, gloo, tiny GLM4-MoE, fp32, R3 with
random routes): two policies of different seed, alpha and learning rate, trained in turns on one core (two rounds
of PPO with 2 mini-batches each, on different data), against each policy trained alone on a core of its own.

Compared bit for bit: the adapters after the last update and the logprobs of both policies (the same float ops
on the same inputs), and each policy's version. Control: the same turns with one AdamW state shared by the two
policies (the swap of the optimizer state left out) end on other adapters for policy a (measured below).
"""
import dataclasses

import pytest
import torch

pytest.importorskip("verl")                       # the policy loss is verl's

A = {"seed": 1, "alpha": 8.0, "lr": 2e-2}
B = {"seed": 2, "alpha": 16.0, "lr": 1e-2}


@pytest.fixture(scope="module")
def world():
    from kit.bank_setup import tiny_world

    return tiny_world()


def _policy(world, seed, alpha, lr):
    from moe_lora_rl.algos import PolicyLossSettings
    from moe_lora_rl.lora import LoRAConfig
    from moe_lora_rl.megatron.layout import Layout
    from moe_lora_rl.policy.core import Policy

    path, rc = world
    return Policy(path, Layout(), rc, LoRAConfig(rank=4, alpha=alpha, init_seed=seed), lr=lr, weight_decay=0.0,
                  grad_clip=1.0, loss=PolicyLossSettings(), micro_batch_size=4)


def _spec(pol, seed, alpha, lr):
    from moe_lora_rl.policy.bank import PolicyAdapter

    return PolicyAdapter(lr=lr, lora=dataclasses.replace(pol.lora, alpha=alpha, init_seed=seed))


def _batches(arch):
    from kit.bank_setup import two_batches

    return two_batches(arch)


def _step(pol, batch):
    from kit.bank_setup import ppo_round

    ppo_round(pol, batch)


def _read(pol, batch):
    from moe_lora_rl.lora import gather_adapters

    return gather_adapters(pol.model), pol.logprobs(batch, replay="r3").logprobs, pol.version


def _together(world, share_state=False):
    from moe_lora_rl.policy.bank import AdapterBank

    pol = _policy(world, **A)
    bank = AdapterBank(pol.core, {"a": _spec(pol, **A), "b": _spec(pol, **B)})
    data = _batches(pol.arch)
    shared = pol.optimizer.state
    for _ in range(2):
        for name in ("a", "b"):
            bank.activate(name)
            if share_state:                           # the control: one AdamW state for both policies
                pol.optimizer.state = shared
            _step(pol, data[name])
    out = {}
    for name in ("a", "b"):
        bank.activate(name)
        out[name] = _read(pol, data["a"])
    pol.replayer.detach()
    return out, bank


@pytest.fixture(scope="module")
def runs(world):
    together, bank = _together(world)
    alone = {}
    for name, kw in (("a", A), ("b", B)):
        pol = _policy(world, **kw)
        data = _batches(pol.arch)
        for _ in range(2):
            _step(pol, data[name])
        alone[name] = _read(pol, data["a"])
        pol.replayer.detach()
    control, _ = _together(world, share_state=True)
    return together, alone, control, bank


def _max_diff(x: dict, y: dict) -> float:
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def test_each_policy_on_one_base_is_its_run_alone(runs):
    together, alone, _, _ = runs
    for name in ("a", "b"):
        (ad, lp, v), (ad0, lp0, v0) = together[name], alone[name]
        assert ad.keys() == ad0.keys() and all(torch.equal(ad[k], ad0[k]) for k in ad0), (name, _max_diff(ad, ad0))
        assert torch.equal(lp, lp0) and v == v0 == 4, (name, v, v0)
    assert _max_diff(together["a"][0], together["b"][0]) > 1e-3          # two policies, not one
    # a's samples scored with b's adapter (the other policy's version) are far from a's own logprobs
    assert float((together["a"][1] - together["b"][1]).abs().max()) > 1e-2


def test_control_one_optimizer_state_for_both_policies_differs(runs):
    together, alone, control, _ = runs
    assert _max_diff(control["a"][0], alone["a"][0]) > 1e-4, _max_diff(control["a"][0], alone["a"][0])


def test_bank_refusals(runs, world):
    from moe_lora_rl.policy.bank import AdapterBank, PolicyAdapter

    _, _, _, bank = runs
    with pytest.raises(ValueError, match="no policy 'c' on this base; policies: \\['a', 'b'\\]"):
        bank.activate("c")
    core = bank.core
    with pytest.raises(ValueError, match="policy 'r8': rank=8 is above the base's adapter rank 4"):
        AdapterBank(core, {"r8": PolicyAdapter(1e-3, dataclasses.replace(core.lora, rank=8))})
    bank.activate("b")
    core.params[0].grad = torch.ones_like(core.params[0])           # the last update's gradients: not b's
    bank.activate("a")
    assert all(p.grad is None for p in core.params)


def test_both_policies_served_side_by_side(runs):
    """Each policy's push names it as the owner: a pin engine with two slots then holds both policies' newest
    versions (the engine's numbers increase over both), and a policy's next push replaces its own version only.
    Control: the same pushes without owners, and the second frees the first."""
    from kit.fakes import FakeEngine

    _, _, _, bank = runs
    core = bank.core
    eng = FakeEngine(core.arch, inflight="pin", max_versions=2)
    sums = {}
    for v, name in enumerate(("a", "b"), start=1):
        bank.activate(name)
        core.push(eng, v, owner=name)
        sums[name] = eng.adapters[v]["checksum"]
    st = eng._rpc_status()
    assert st["versions"] == [1, 2] and st["owners"] == {"1": "a", "2": "b"} and sums["a"] != sums["b"]
    bank.activate("a")
    core.push(eng, 3, owner="a")
    assert eng._rpc_status()["versions"] == [2, 3] and eng.adapters[3]["checksum"] == sums["a"]
    plain = FakeEngine(core.arch, inflight="pin", max_versions=2)
    core.push(plain, 1)
    bank.activate("b")
    core.push(plain, 2)
    assert plain._rpc_status()["versions"] == [2]
