"""megatron-core 0.16.x without Transformer Engine, on any device: RouterGatingLinearFunction reads
`moe_utils.te_general_gemm`, a name that module imports only when TE is installed, so the first router forward
raises NameError (fixed in 0.19, which binds it to None). Applied once by the caller (run_config.prepare_host, for
CUDA runs on the local spec; megatron-core's CPU support carries the same fix for CPU runs), never at import time;
listed in patches/README.md.

    handle = te_gemm_fix.apply()      # None where nothing is needed (TE present, or megatron-core >= 0.19)
    handle.restore()
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TeGemmFix:
    module: object

    def restore(self) -> None:
        if hasattr(self.module, "te_general_gemm"):
            delattr(self.module, "te_general_gemm")


def needed(version: str, module) -> bool:
    """Whether megatron-core `version`'s moe_utils `module` lacks the name (pure)."""
    return version.startswith("0.16.") and not hasattr(module, "te_general_gemm")


def apply() -> TeGemmFix | None:
    from megatron.core.transformer.moe import moe_utils

    from .cpu_support import mcore_version

    if not needed(mcore_version(), moe_utils):
        return None
    moe_utils.te_general_gemm = None          # the router then takes its torch matmul path
    return TeGemmFix(moe_utils)
