"""Several policies' adapters on one training core: one Megatron base, N adapter sets of one shape, one of them
active (its tensors in the model's adapter parameters). Switching swaps references, copies nothing: the
parameters' storage, the optimizer's per-parameter state (AdamW moments and step), the learning rate, the LoRA
scale (alpha / rank), the LoRA config the refit header and the PEFT export read, and the adapter version.

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
        """core: a TrainingCore with an optimizer; policies: name -> its learning rate and LoRA config (same rank,
        targets and adapter layout as the core's; alpha and init_seed its own). The first policy is active."""
        if not policies:
            raise ValueError("AdapterBank needs at least one policy")
        if core.optimizer is None:
            raise ValueError("AdapterBank needs a training core with an optimizer")
        shape = _shape(core.lora)
        for name, spec in policies.items():
            if _shape(spec.lora) != shape:
                raise ValueError(f"policy {name!r}: LoRA rank/targets/adapter layout {_shape(spec.lora)} differ from "
                                 f"the base's adapters {shape}: one adapter shape per base")
            if not spec.lr >= 0:
                raise ValueError(f"policy {name!r}: lr={spec.lr!r} must be >= 0")
        self.core = core
        self.adapters = [m for m in core.model.modules() if isinstance(m, LoRAAdapter)]
        self.slots = {name: _Slot(spec, [initial_factor(p, spec.lora.init_seed) for p in core.params])
                      for name, spec in policies.items()}
        self.active: str | None = None
        self.activate(next(iter(policies)))

    @property
    def names(self) -> list[str]:
        return list(self.slots)

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
        core.lora = core.model.lora_config = new.spec.lora
        core.version = new.version
        new.tensors = []                          # the parameters hold them while active
        self.active = name

    def _slot(self, name: str) -> _Slot:
        if name not in self.slots:
            raise ValueError(f"no policy {name!r} on this base; policies: {self.names}")
        return self.slots[name]


def _shape(lora: LoRAConfig) -> tuple:
    return lora.rank, tuple(sorted(lora.targets)), lora.adapter_layout
