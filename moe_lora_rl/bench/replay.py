"""replay: R3 on a vLLM bf16 rollout vs Megatron fp32 recompute, side by side in one run.

    python -m moe_lora_rl.bench replay --json [--model DIR] [--layouts tp1ep1pp1]

disagreement_*: fraction of router decisions that differ from the rollout's, without / with R3 (padded batch).
kl_*: k3 estimate of KL(rollout || training) on the rollout's tokens. capture_overhead: 1 - tokens/s with capture
/ tokens/s without (interleaved off/on/off/on). bytes_per_token: stored routes per token. replay_step_overhead:
Megatron forward time with replay / without - 1.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from .common import emit


def main(argv=None) -> dict:
    from . import replay_check

    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench replay", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the medium qwen3_moe)")
    ap.add_argument("--layouts", default="tp1ep1pp1")
    ap.add_argument("--engine", default="vllm", choices=("vllm", "hf"))
    a = ap.parse_args(argv)
    if a.model is None:
        from ..models import get_model

        a.model = str(get_model("qwen3_moe", "medium"))
    layout = a.layouts.split(",")[0]
    with tempfile.TemporaryDirectory() as d:
        res = replay_check.run([a.model], layout, Path(d), engine=a.engine,
                               overhead_batches=3 if a.engine == "vllm" else 0, timing=3)
        roll = torch.load(Path(d) / "rollout.pt")[a.model]
    r = res[layout][a.model]
    p = r["padded"]
    cap = roll.get("capture") or {}
    result = {"disagreement_without": p["disagreement_without"], "disagreement_with": p["disagreement_with"],
              "kl_without": p["kl_without"], "kl_with": p["kl_with"],
              "kl_ratio": p["kl_without"] / p["kl_with"] if p["kl_with"] > 0 else float("inf"),
              "capture_overhead": cap.get("capture_overhead"), "bytes_per_token": roll["bytes_per_token"],
              "replay_step_overhead": r["forward_s"]["with_replay"] / r["forward_s"]["without"] - 1,
              "packed": r["packed"], "model": a.model, "layout": layout, "engine": a.engine,
              "tps_without": cap.get("tps_without"), "tps_with": cap.get("tps_with")}
    emit(result, a.json)
    return result
