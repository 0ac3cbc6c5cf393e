"""The run config's model-side settings: which checkpoint (and its warm start), the parallel layout, the runtime
(device, dtypes, expert kernels) and the LoRA adapters; each validated in __post_init__ (ValueError naming the
value). Composed into rl/config/'s TrainConfig."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ...lora.config import DTYPES as LORA_DTYPES
from ...lora.config import LAYOUTS as LORA_LAYOUTS
from ...lora.config import LoRAConfig
from ...megatron.layout import Layout
from .rollout_settings import _choice

DEVICES = ("cpu", "cuda")
EXPERTS = ("sequential", "grouped")
DTYPES = ("float32", "bfloat16")


@dataclass
class ModelSettings:
    family: str = "glm4_moe"
    """Model family of the built-in checkpoints (moe_lora_rl.models)."""
    size: str = "wide"
    """Built-in size: tiny, small (the former RL default: 16 experts, top-4), wide (the RL default: 128 experts, top-8,
    routing as fragile as a real MoE's), medium."""
    path: Optional[str] = None
    """An HF checkpoint directory to use instead of the built-in model (no warm start is run for it)."""
    warm_start: bool = True
    """Start from the cached supervised warm start of the built-in model on the task."""
    warm_steps: Optional[int] = None
    """Supervised steps of that warm start (None: the task's, data/warm_start.py TASK_WARM_STARTS); each count is its
    own cached checkpoint."""

    def __post_init__(self):
        from ...models.tiny import SPECS

        if self.warm_steps is not None and (isinstance(self.warm_steps, bool) or not isinstance(self.warm_steps, int)
                                            or self.warm_steps < 1):
            raise ValueError(f"model.warm_steps={self.warm_steps!r} must be an integer >= 1 (or null: the task's)")
        if self.warm_steps is not None and (self.path is not None or not self.warm_start):
            raise ValueError(f"model.warm_steps={self.warm_steps} sets the built-in warm start's steps: it does not "
                             "apply with model.path or model.warm_start=false")
        if self.path is None and (self.family, self.size) not in SPECS:
            raise ValueError(f"model family/size {self.family!r}/{self.size!r} is not built in; known: "
                             f"{sorted(SPECS)} (or set model.path)")
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"model.path={self.path!r} is not a directory")


@dataclass
class LayoutSettings:
    tp: int = 1
    etp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self):
        self.layout()                     # Layout validates each size

    def layout(self) -> Layout:
        return Layout(tp=self.tp, ep=self.ep, etp=self.etp, pp=self.pp)


@dataclass
class RuntimeSettings:
    device: str = "cpu"
    train_dtype: str = "float32"
    """Megatron parameters and compute."""
    rollout_dtype: str = "bfloat16"
    """vLLM serving dtype."""
    experts: str = "sequential"
    """Megatron's routed experts: sequential (SequentialMLP, one expert after another) or grouped (the legacy
    GroupedMLP, grouped GEMMs over every local expert at once; megatron-core 0.16 only, bf16 on cuda): the same
    products (bit for bit in fp32 on CPU, tests/distributed/test_minibatch_update.py), a third less trainer time
    per step on the default 128-expert model on CPU."""

    def __post_init__(self):
        _choice("runtime.experts", self.experts, EXPERTS)
        _choice("runtime.device", self.device, DEVICES)
        _choice("runtime.train_dtype", self.train_dtype, DTYPES)
        _choice("runtime.rollout_dtype", self.rollout_dtype, DTYPES)


@dataclass
class LoRASettings:
    rank: int = 8
    alpha: float = 16.0
    adapter_layout: str = "per_expert"
    targets: list = field(default_factory=lambda: ["experts", "attention"])
    dtype: str = "float32"

    def __post_init__(self):
        _choice("lora.adapter_layout", self.adapter_layout, LORA_LAYOUTS)
        _choice("lora.dtype", self.dtype, LORA_DTYPES)
        self.lora_config()                # LoRAConfig validates rank, alpha and targets

    def lora_config(self, init_seed: int = 0) -> LoRAConfig:
        return LoRAConfig(rank=self.rank, alpha=float(self.alpha), targets=tuple(self.targets),
                          adapter_layout=self.adapter_layout, dtype=self.dtype, init_seed=init_seed)
