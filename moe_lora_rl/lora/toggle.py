"""Run a model with its adapters switched off (the reference policy of a KL term): every adapter's scale is 0 inside
the scope, so each adapted linear returns exactly its base output (base + 0), and restored on exit."""
from __future__ import annotations

import contextlib

from torch import nn

from .layers import LoRAAdapter


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    adapters = [m for m in model.modules() if isinstance(m, LoRAAdapter)]
    if not adapters:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to disable")
    scales = [a.scale for a in adapters]
    for a in adapters:
        a.scale = 0.0
    try:
        yield model
    finally:
        for a, s in zip(adapters, scales):
            a.scale = s
