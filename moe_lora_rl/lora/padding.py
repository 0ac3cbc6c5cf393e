"""Adapters of several ranks and target sets on one set of adapter modules (pure): the modules take the largest
rank and every policy's targets; a policy of rank r on targets T holds zeros outside its first r ranks and outside
T. Such a policy computes what an adapter of rank r on T computes, and its zeros get zero gradients (a zero row of
A meets a zero column of B; a linear outside T has both factors zero), so AdamW leaves them zero: it trains as it
would alone. The module scale is the policy's own (alpha / r); what goes to the engine carries the module's rank
with alpha scaled so that the engine's alpha / rank is the policy's scale.

    module = module_shape([cfg_a, cfg_b])          # rank max(r_a, r_b), targets a's and b's
    pad_factor(t, p.lora_meta, cfg_a)              # zeros outside a's ranks and targets, in place
    push_config(module, cfg_a)                     # the module's shape, a's scale
"""
from __future__ import annotations

import dataclasses

import torch

from .config import LoRAConfig, expand
from .layers import FactorMeta


def module_shape(configs: list[LoRAConfig]) -> tuple[int, tuple[str, ...]]:
    """(rank, targets) of adapter modules that hold every config: the largest rank, every config's targets (as
    given, in order of first appearance)."""
    if not configs:
        raise ValueError("module_shape needs at least one LoRA config")
    layouts = sorted({c.adapter_layout for c in configs})
    if len(layouts) > 1:
        raise ValueError(f"adapter layouts {layouts}: the adapters on one base share one layout")
    targets: list[str] = []
    for c in configs:
        targets += [t for t in c.targets if t not in targets]
    return max(c.rank for c in configs), tuple(targets)


def check_fits(module: LoRAConfig, policy: LoRAConfig, name: str) -> None:
    """ValueError naming the policy whose rank, targets or layout the modules cannot hold."""
    if policy.adapter_layout != module.adapter_layout:
        raise ValueError(f"policy {name!r}: adapter_layout={policy.adapter_layout!r}, the base's adapters are "
                         f"{module.adapter_layout!r}")
    if policy.rank > module.rank:
        raise ValueError(f"policy {name!r}: rank={policy.rank} is above the base's adapter rank {module.rank}")
    held = set(module.resolved_targets())
    extra = [t for t in policy.targets if not set(expand(t)) <= held]     # in the policy's own words
    if extra:
        raise ValueError(f"policy {name!r}: targets {extra} are not adapted on this base "
                         f"(its adapters: {list(module.targets)})")


def holds(meta: FactorMeta, policy: LoRAConfig) -> bool:
    """Is this factor's linear one of the policy's targets?"""
    if not meta.target:
        raise ValueError(f"factor {meta.global_name}: its target is not known")
    return meta.target in policy.resolved_targets()


def pad_factor(t: torch.Tensor, meta: FactorMeta, policy: LoRAConfig) -> torch.Tensor:
    """Zero, in place, what lies outside the policy: the whole factor off its targets; past its rank, the rows of A
    ([rank, in]) or the columns of B ([out, rank], GLU [2 * out, rank]). Returns t."""
    if not holds(meta, policy):
        return t.zero_()
    if meta.global_name.endswith("lora_A"):
        t[policy.rank:] = 0
    else:
        t[..., policy.rank:] = 0
    return t


def push_config(module: LoRAConfig, policy: LoRAConfig) -> LoRAConfig:
    """The config a padded policy is pushed and checkpointed with: the module's rank and targets, the policy's scale
    (alpha * module rank / policy rank) and init seed."""
    return dataclasses.replace(module, alpha=policy.alpha * module.rank / policy.rank, init_seed=policy.init_seed)


def trim_peft(tensors: dict[str, torch.Tensor], policy: LoRAConfig, target_of) -> dict[str, torch.Tensor]:
    """A padded policy's PEFT tensors cut to what it holds: its targets' modules only (target_of(name) -> target),
    lora_A [:rank], lora_B [:, :rank]. ValueError if a cut part is not zero (the tensors are not that policy's)."""
    out, wanted = {}, set(policy.resolved_targets())
    for name, t in tensors.items():
        a = ".lora_A." in name
        cut = t.clone()
        kept = target_of(name) in wanted
        if kept:
            (cut[:policy.rank] if a else cut[:, :policy.rank]).zero_()
        if cut.count_nonzero():
            raise ValueError(f"{name}: nonzero values outside policy rank {policy.rank} / targets "
                             f"{list(policy.targets)}: not a padded adapter of that policy")
        if kept:
            out[name] = (t[:policy.rank] if a else t[:, :policy.rank]).contiguous()
    return out
