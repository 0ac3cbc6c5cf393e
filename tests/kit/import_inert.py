"""A fresh interpreter's check that importing every module of the package replaces no attribute of torch.cuda or of
the megatron-core modules and classes cpu_support or the replay hooks touch (no patching at import time). Run as
`python -c IMPORT_CHECK [more code]`: it prints "IMPORTED n" and "CHANGED [names]"; `facts(stdout)` reads them back.
Code appended after it runs in the same process (tests/unit/test_verl_config.py shares the interpreter: the walk
imports no verl)."""
from __future__ import annotations

IMPORT_CHECK = r"""
import importlib, pkgutil, sys
import torch, torch.cuda
import megatron.core.tensor_parallel.mappings, megatron.core.tensor_parallel.random
import megatron.core.transformer.moe.moe_utils, megatron.core.transformer.moe.token_dispatcher
import megatron.core.transformer.moe.router, megatron.core.transformer.moe.moe_layer
import megatron.core.ssm.gated_delta_net
targets = [torch.cuda, megatron.core.tensor_parallel.mappings, megatron.core.tensor_parallel.random,
           megatron.core.tensor_parallel.random.CudaRNGStatesTracker,
           megatron.core.tensor_parallel.random.CheckpointWithoutOutput, megatron.core.transformer.moe.moe_utils,
           megatron.core.transformer.moe.token_dispatcher, megatron.core.transformer.moe.router.TopKRouter,
           megatron.core.transformer.moe.moe_layer.MoELayer, megatron.core.ssm.gated_delta_net]
try:
    import megatron.core.transformer.moe.grouped_gemm_util as g
    targets.append(g)
except ImportError:
    pass
before = [dict(vars(t)) for t in targets]
import moe_lora_rl
names = []
for pkg in ("megatron", "router_replay", "lora", "models", "refit", "policy", "checkpoint", "rollout", "checks",
            "bench"):
    mod = importlib.import_module(f"moe_lora_rl.{pkg}")
    for info in pkgutil.walk_packages(mod.__path__, f"moe_lora_rl.{pkg}."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
changed = [f"{getattr(t, '__name__', t)}.{k}" for t, b in zip(targets, before) for k in set(b) | set(vars(t))
           if b.get(k, None) is not vars(t).get(k, None)]
print("IMPORTED", len(names))
print("CHANGED", changed)
"""


def facts(stdout: str) -> dict[str, str]:
    """{"IMPORTED": "n", "CHANGED": "[...]"} from IMPORT_CHECK's output."""
    return dict(l.split(" ", 1) for l in stdout.splitlines() if l.startswith(("IMPORTED", "CHANGED")))
