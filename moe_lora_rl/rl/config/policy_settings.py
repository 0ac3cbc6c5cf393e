"""Several policies on one base (pure): the run config's `policies` list, its checks, and each policy's own run
config, the one it would be trained with alone.

    policies: [{name: a, seed: 1}, {name: b, seed: 2, lr: 3e-3, task: sort_trace}]

A policy is the run's settings with a few of them replaced (its seed, which also seeds its adapter's
initialisation, learning rate, alpha, rank, targets, task or data files, staleness bound) and its outputs under
out_dir/<name>/. The shared base's adapter modules take the largest rank and every policy's targets
(`module_lora`); a policy of a lower rank or fewer targets holds zeros outside its own (lora/padding.py) and trains
exactly as its own shape would alone. The adapter layout is one for all (`lora.adapter_layout`).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Optional

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass
class PolicySettings:
    name: str = ""
    """The policy's name: its outputs go to out_dir/<name>/ (letters, digits, '_', '.', '-')."""
    seed: Optional[int] = None
    """Its seed (problem order, sampling seeds, its adapter's initialisation); null: the run's."""
    lr: Optional[float] = None
    """Its learning rate; null: algo.lr."""
    alpha: Optional[float] = None
    """Its LoRA alpha; null: lora.alpha."""
    rank: Optional[int] = None
    """Its LoRA rank; null: lora.rank."""
    targets: Optional[list] = None
    """Its LoRA targets; null: lora.targets."""
    task: Optional[str] = None
    """Its task (data.task); null: the run's."""
    length: Optional[int] = None
    """Its data.length; null: the run's."""
    train_files: Any = None
    """Its data.train_files (a file or a list); null: the run's."""
    val_files: Any = None
    """Its data.val_files; null: the run's."""
    train_file: Optional[str] = None
    """Alias of train_files."""
    eval_file: Optional[str] = None
    """Alias of val_files."""
    max_staleness: Optional[int] = None
    """mode=async: its staleness bound; null: the run's."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not NAME.match(self.name):
            raise ValueError(f"policies: name={self.name!r} must be 1-64 letters, digits, '_', '.' or '-' "
                             "(it names the policy's output folder)")
        if self.targets is not None:
            self.targets = list(self.targets)           # a ListConfig from hydra


def check_policies(policies: list, *, rollout, mode: str, inflight: str, max_staleness: int) -> None:
    """The checks that need the whole list (ValueError naming the value): names unique and the engine's adapter
    slots enough for every policy's versions at once (each policy's own values are checked by policy_config)."""
    if policies and mode == "async" and inflight != "pin":
        raise ValueError(f"policies with mode=async and inflight={inflight}: the engine serves several policies by "
                         "pinning each request to its own policy's version; set inflight=pin")
    names = [p.name for p in policies]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"policies: name {dup[0]!r} is given {names.count(dup[0])} times; each policy needs its own "
                         "name (its outputs go to out_dir/<name>/)")
    need = sum(slots(p, mode=mode, inflight=inflight, max_staleness=max_staleness) for p in policies)
    if policies and need > rollout.max_versions:
        raise ValueError(f"policies: {len(policies)} policies need {need} adapter slots in the engine at once, "
                         f"rollout.max_versions={rollout.max_versions} (raise it, or run fewer policies)")


def slots(p: PolicySettings, *, mode: str, inflight: str, max_staleness: int) -> int:
    """Adapter versions a policy may need the engine to hold at once: its newest, and with mode=async and
    inflight=pin the older ones its running requests still use (max_staleness + 1 in all)."""
    bound = p.max_staleness if p.max_staleness is not None else max_staleness
    return bound + 1 if mode == "async" and inflight == "pin" else 1


def policy_config(cfg, p: PolicySettings):
    """The run config policy `p` would be trained with alone: cfg with p's settings in place, no policies, and its
    outputs in out_dir/<name>/ (validated as any run config)."""
    r = dataclasses.replace
    files = {new: getattr(p, new) if getattr(p, new) is not None else getattr(p, old)
             for new, old in (("train_files", "train_file"), ("val_files", "eval_file"))}
    data = r(cfg.data, **{k: getattr(p, k) for k in ("task", "length") if getattr(p, k) is not None},
             **{k: v for k, v in files.items() if v is not None})
    algo = r(cfg.algo, lr=p.lr) if p.lr is not None else cfg.algo
    lora = r(cfg.lora, **{k: getattr(p, k) for k in ("alpha", "rank", "targets") if getattr(p, k) is not None})
    extra = {"seed": p.seed} if p.seed is not None else {}
    if p.max_staleness is not None:
        extra["max_staleness"] = p.max_staleness
    return r(cfg, data=data, algo=algo, lora=lora, policies=[], out_dir=f"{cfg.out_dir}/{p.name}", **extra)


def policy_configs(cfg) -> list[tuple[str, object]]:
    """(name, run config) of every policy, in the order given."""
    return [(p.name, policy_config(cfg, p)) for p in cfg.policies]


def module_lora(cfg):
    """The lora section of the shared base's adapter modules: the largest of the policies' ranks, every policy's
    targets (cfg.lora itself when there are no policies)."""
    from ...lora.padding import module_shape

    if not cfg.policies:
        return cfg.lora
    rank, targets = module_shape([pcfg.lora.lora_config() for _, pcfg in policy_configs(cfg)])
    return dataclasses.replace(cfg.lora, rank=rank, targets=list(targets))
