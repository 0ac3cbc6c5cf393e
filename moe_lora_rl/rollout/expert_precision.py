"""The unmerged experts' GEMM precision a rollout engine is asked for (vllm/moe_torch.EXPERT_PRECISION): one check for
the job's config, the client and the server, each naming the settings the way its user wrote them."""
from __future__ import annotations

from ..vllm.moe_torch import EXPERT_PRECISION


def check_expert_precision(value, serving: str, name: str = "expert_precision", serving_name: str = "serving"):
    """Refuse an unknown precision, and any precision but the serving dtype's with merged serving (merged experts run
    in vLLM's own fused kernel, so the setting would do nothing)."""
    if value not in EXPERT_PRECISION:
        raise ValueError(f"{name}={value!r}: expected one of {sorted(EXPERT_PRECISION)}")
    if value != "serving" and serving == "merged":
        raise ValueError(f"{name}={value} with {serving_name}=merged: merged experts run in vLLM's own kernel; the "
                         "precision is unmerged serving's")
