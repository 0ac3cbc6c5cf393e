"""Several policies' adapters on one training core: one Megatron base, N adapter sets in the modules' shape, one of
them active (its tensors in the model's adapter parameters). A policy of a lower rank or fewer targets than the
modules holds zeros outside its own (lora/padding.py) and trains exactly as an adapter of its own shape. Switching swaps references, copies nothing: the
parameters' storage, the optimizer's per-parameter state (AdamW moments and step), the learning rate, the LoRA
scale (its alpha / its rank), the LoRA config the refit header and checkpoints read (the modules' rank and
targets at the policy's scale), and the adapter version.

    bank = AdapterBank(core, {"a": PolicyAdapter(lr=1e-3, lora=cfg_a), "b": PolicyAdapter(lr=3e-3, lora=cfg_b)})
    bank.activate("b")       # the core now trains, scores and pushes policy b, exactly as a core of b alone
    bank.version("a")        # a's adapter version, whichever is active

Each policy starts from the adapters apply_lora gives its LoRA config (its init_seed), so a policy trained here
takes the same steps as the same policy trained alone on a core of its own (tests/distributed/test_bank.py).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ..lora import LoRAConfig
from ..lora.apply import initial_factor
from ..lora.layers import LoRAAdapter
from ..lora.padding import check_fits, pad_factor, push_config


@dataclass(frozen=True)
class PolicyAdapter:
    lr: float
    lora: LoRAConfig


@dataclass
class _Slot:
    spec: PolicyAdapter
    tensors: list
    state: dict = field(default_factory=lambda: defaultdict(dict))
    version: int = 0


class AdapterBank:
    def __init__(self, core, policies: dict[str, PolicyAdapter]):
        """core: a TrainingCore with an optimizer; policies: name -> its learning rate and its own LoRA config (a
        rank up to the core's, targets among the core's, the core's adapter layout). The first policy is active."""
        if not policies:
            raise ValueError("AdapterBank needs at least one policy")
        if core.optimizer is None:
            raise ValueError("AdapterBank needs a training core with an optimizer")
        self.module = core.lora                   # the adapter modules' shape
        for name, spec in policies.items():
            check_fits(self.module, spec.lora, name)
            if not spec.lr >= 0:
                raise ValueError(f"policy {name!r}: lr={spec.lr!r} must be >= 0")
        self.core = core
        self.adapters = [m for m in core.model.modules() if isinstance(m, LoRAAdapter)]
        self.slots = {name: _Slot(spec, [pad_factor(initial_factor(p, spec.lora.init_seed, spec.lora.a_init), p.lora_meta, spec.lora)
                                         for p in core.params])
                      for name, spec in policies.items()}
        self.active: str | None = None
        self.activate(next(iter(policies)))

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def lora(self, name: str) -> LoRAConfig:
        """The policy's own LoRA config (its rank and targets, not the modules')."""
        return self._slot(name).spec.lora

    def version(self, name: str) -> int:
        self._slot(name)
        return self.core.version if name == self.active else self.slots[name].version

    def activate(self, name: str) -> None:
        """Make `name` the core's policy (between updates; the last update's gradients are dropped)."""
        new = self._slot(name)
        if name == self.active:
            return
        core = self.core
        core.zero_grad()
        if self.active is not None:
            cur = self.slots[self.active]
            cur.tensors = [p.data for p in core.params]
            cur.state, cur.version = core.optimizer.state, core.version
        for p, t in zip(core.params, new.tensors):
            p.data = t
        core.optimizer.state = new.state
        for g in core.optimizer.param_groups:
            g["lr"] = new.spec.lr
        for m in self.adapters:
            m.scale = new.spec.lora.scale
        core.lora = core.model.lora_config = push_config(self.module, new.spec.lora)
        core.version = new.version
        new.tensors = []                          # the parameters hold them while active
        self.active = name

    def _slot(self, name: str) -> _Slot:
        if name not in self.slots:
            raise ValueError(f"no policy {name!r} on this base; policies: {self.names}")
        return self.slots[name]
