"""Policies of different ranks and targets on one base (policy/bank.py with lora/padding.py), in one process (world
size 1, gloo, tiny GLM4-MoE, fp32, R3 with random routes): the base's adapter modules have rank 8 on the experts and
attention; policy a has rank 4 on the experts only, policy b the modules' shape. Trained in turns (two rounds of
PPO with 2 mini-batches each, on different data) against a trained alone on a core of rank 4 on the experts.

Compared: a's logprobs and its PEFT adapter cut to its own shape (lora/padding.trim_peft) against the rank-4 core's,
and what lies outside a's ranks and targets is still exactly zero after training (trim_peft refuses anything else).
Not bit for bit: the first update's gradients are equal bit for bit, the second's within 2e-6 (relative; a GEMM
over 8 ranks of which 4 are zero rounds differently from one over 4), and AdamW divides by the root of the squared
gradients, so elements whose gradients are ~1e-8 carry that into the adapters: measured 5.1e-5 on the adapters and
8.4e-5 on the logprobs after 8 updates, asserted within 5e-4. Controls: without the zeros (a's factors drawn at the
modules' rank on every target) the same turns end far off (logprobs 25 apart); b's adapter does not cut to a's shape.
"""
import dataclasses

import pytest
import torch

pytest.importorskip("verl")                       # the policy loss is verl's

MODULE = {"rank": 8, "targets": ("experts", "attention")}
A = {"seed": 1, "alpha": 8.0, "lr": 2e-2, "rank": 4, "targets": ("experts",)}
B = {"seed": 2, "alpha": 16.0, "lr": 1e-2, **MODULE}


@pytest.fixture(scope="module")
def world():
    from kit.bank_setup import tiny_world

    return tiny_world()


def _lora(seed, alpha, rank, targets, lr=None):
    from moe_lora_rl.lora import LoRAConfig

    return LoRAConfig(rank=rank, alpha=alpha, targets=targets, init_seed=seed)


def _policy(world, lora, lr):
    from moe_lora_rl.algos import PolicyLossSettings
    from moe_lora_rl.megatron.layout import Layout
    from moe_lora_rl.policy.core import Policy

    path, rc = world
    return Policy(path, Layout(), rc, lora, lr=lr, weight_decay=0.0, grad_clip=1.0, loss=PolicyLossSettings(),
                  micro_batch_size=4)


def _batches(arch):
    from kit.bank_setup import two_batches

    return two_batches(arch)


def _step(pol, batch):
    from kit.bank_setup import ppo_round

    ppo_round(pol, batch)


def _peft(pol):
    from moe_lora_rl.lora import gather_adapters
    from moe_lora_rl.refit.rename import to_peft_tensors

    return to_peft_tensors(gather_adapters(pol.model), pol.arch)


def _together(pol, pad=True):
    """Both policies trained in turns on a bank over pol's core (a fresh bank: each policy from its own start)."""
    from moe_lora_rl.policy import bank as bank_mod
    from moe_lora_rl.policy.bank import AdapterBank, PolicyAdapter

    original = bank_mod.pad_factor
    if not pad:                                       # the control: a's factors drawn at the modules' shape
        bank_mod.pad_factor = lambda t, meta, lora: t
    try:
        bank = AdapterBank(pol.core, {"a": PolicyAdapter(A["lr"], _lora(**A)), "b": PolicyAdapter(B["lr"], _lora(**B))})
    finally:
        bank_mod.pad_factor = original
    data = _batches(pol.arch)
    for _ in range(2):
        for name in ("a", "b"):
            bank.activate(name)
            _step(pol, data[name])
    out = {}
    for name in ("a", "b"):
        bank.activate(name)
        out[name] = (_peft(pol), pol.logprobs(data["a"], replay="r3").logprobs, pol.version,
                     pol.core.lora, [m.scale for m in bank.adapters][:1])
    return out


@pytest.fixture(scope="module")
def runs(world):
    base = _policy(world, _lora(seed=0, alpha=16.0, **MODULE), lr=1e-3)
    together = _together(base)
    control = _together(base, pad=False)
    base.replayer.detach()
    pol = _policy(world, _lora(**A), lr=A["lr"])
    data = _batches(pol.arch)
    for _ in range(2):
        _step(pol, data["a"])
    alone = (_peft(pol), pol.logprobs(data["a"], replay="r3").logprobs, pol.version)
    pol.replayer.detach()
    return together, alone, control, pol.core


def _cut(world, peft, lora):
    from moe_lora_rl.lora.padding import trim_peft
    from moe_lora_rl.models.naming import naming_for

    naming = naming_for("glm4_moe")
    return trim_peft(peft, lora, lambda n: naming.parse_peft(n)[0].linear.target)


def _max_diff(x: dict, y: dict) -> float:
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def test_a_lower_rank_policy_on_a_larger_base_is_its_run_alone(runs, world):
    together, alone, _, _ = runs
    (peft, lp, v, pushed, scale), (peft0, lp0, v0) = together["a"], alone
    own = _cut(world, peft, _lora(**A))
    assert own.keys() == peft0.keys() and all(own[k].shape == peft0[k].shape for k in own)
    assert any(".experts." in k for k in own) and not any("self_attn" in k for k in own)
    assert _max_diff(own, peft0) < 5e-4 and max(float(t.abs().max()) for t in peft0.values()) > 1e-2
    assert float((lp - lp0).abs().max()) < 5e-4 and v == v0 == 4, (float((lp - lp0).abs().max()), v, v0)
    # pushed and checkpointed at the modules' shape with a's scale: alpha 8 * 8 / 4 over rank 8 = 8 / 4
    assert (pushed.rank, pushed.targets, pushed.alpha) == (8, MODULE["targets"], 16.0) and scale == [2.0]


def test_b_at_the_modules_shape_cuts_to_nothing_smaller(runs, world):
    together, _, _, _ = runs
    peft_b = together["b"][0]
    assert any("self_attn" in k and float(t.abs().max()) > 0 for k, t in peft_b.items() if ".lora_B." in k)
    with pytest.raises(ValueError, match="nonzero values outside policy rank 4"):
        _cut(world, peft_b, _lora(**A))            # b's adapter is not a padded rank-4 experts-only adapter
    assert _max_diff(_cut(world, peft_b, _lora(**B)), peft_b) == 0.0


def test_control_without_the_zeros_a_trains_elsewhere(runs):
    _, alone, control, _ = runs
    peft, lp, _, _, _ = control["a"]
    lp0 = alone[1]
    assert float((lp - lp0).abs().max()) > 5e-2, float((lp - lp0).abs().max())
    assert any(float(t.abs().max()) > 0 for k, t in peft.items() if "self_attn" in k and ".lora_B." in k)


def test_bank_refusals_name_the_policy(runs, world):
    from moe_lora_rl.policy.bank import AdapterBank, PolicyAdapter

    core = runs[3]                                    # rank 4 on the experts
    with pytest.raises(ValueError, match="policy 'big': rank=8 is above the base's adapter rank 4"):
        AdapterBank(core, {"big": PolicyAdapter(1e-3, _lora(seed=1, alpha=8.0, rank=8, targets=("experts",)))})
    with pytest.raises(ValueError, match=r"policy 'att': targets \['attention'\] are not adapted on this base"):
        AdapterBank(core, {"att": PolicyAdapter(1e-3, _lora(seed=1, alpha=8.0, rank=4, targets=("attention",)))})
    with pytest.raises(ValueError, match="policy 'sh': adapter_layout='shared'"):
        AdapterBank(core, {"sh": PolicyAdapter(1e-3, dataclasses.replace(core.lora, adapter_layout="shared"))})
