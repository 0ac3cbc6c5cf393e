"""replay: R3 on a vLLM bf16 rollout vs Megatron recompute (fp32; bf16 with --dtype bf16), checked against a
forced-route reference.

    python -m moe_lora_rl.bench replay --json [--model DIR ...] [--layouts tp1ep1pp1,ep4] [--engine vllm|hf]
        [--dtype fp32|bf16]

replay_fidelity_max_diff: worst max |fp32 logit diff| over layouts, models, padded/packed (packed refused on a hybrid
linear-attention model: per_layout says so), between Megatron replaying
a forced set (the rollout's routes; random valid routes) and HF transformers forced to the same routes. Target 1e-4.
shuffled_routes_diff: the smallest such diff when Megatron replays the rollout routes shuffled across tokens (the
negative control; must exceed 1e-2). forced_decisions_differ: fraction of forced decisions that the fp32 router,
given the same inputs, would not pick (both sets; target >= 0.05), with the rollout set alone beside it.
dispatcher_mismatched_tokens: tokens whose routing map at Megatron's token dispatcher differs from the rollout-format
routes (target 0). disagreement_without: router decisions differing from the rollout's without replay.
kl_*: k3 estimate of KL(rollout || training) on the rollout's tokens, kl_ratio = without / with (target >= 2).
capture_overhead: 1 - tokens/s with capture / without (interleaved). bytes_per_token: stored routes per token.
replay_step_overhead: Megatron forward time with replay / without - 1. kl, disagreement and timings are from the
first layout; per_layout has everything.
--dtype bf16 runs Megatron in bf16 (the reference stays fp32) and reports replay_fidelity_max_diff_bf16 (max |logit
diff|) and replay_fidelity_max_rel_bf16: the worst token's max |logit diff| / max |reference logit|, target 16u
(u = 2^-8), with shuffled_routes_rel beside it.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from .emit import emit
from .run_args import add_run_args, run_config_from_args


def summarize(res: dict, models: list[str], layouts: list[str], dtype: str = "fp32") -> dict:
    per = {l: {m: res[l][m] for m in models} for l in layouts}
    kinds = [r[k] for l in layouts for r in per[l].values() for k in ("padded", "packed") if "refused" not in r[k]]
    bad = sum(b for m in models for b, _ in res["forced_decisions"][m].values())
    tot = sum(t for m in models for _, t in res["forced_decisions"][m].values())
    roll = [res["forced_decisions"][m]["rollout"] for m in models]
    out = {"replay_fidelity_max_diff": max(max(k["fidelity_max_diff"].values()) for k in kinds),
           "shuffled_routes_diff": min(k["shuffled_routes_diff"] for k in kinds)}
    if dtype != "fp32":
        out = {f"replay_fidelity_max_diff_{dtype}": out["replay_fidelity_max_diff"],
               f"replay_fidelity_max_rel_{dtype}": max(max(k["fidelity_max_rel"].values()) for k in kinds),
               "shuffled_routes_diff": out["shuffled_routes_diff"],
               "shuffled_routes_rel": min(k["shuffled_routes_rel"] for k in kinds)}
    return {**out, "dtype": dtype,
            "forced_decisions_differ": bad / tot,
            "forced_decisions_differ_rollout": sum(b for b, _ in roll) / sum(t for _, t in roll),
            "dispatcher_mismatched_tokens": sum(sum(k["dispatcher_mismatched_tokens"].values()) for k in kinds),
            "dispatcher_tokens": sum(sum(k["dispatcher_tokens"].values()) for k in kinds), "per_layout": per}


def main(argv=None) -> dict:
    from ..checks import r3_run as replay_check

    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench replay", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", action="append", help="HF checkpoint dir (repeatable; default: the medium qwen3_moe)")
    ap.add_argument("--layouts", default="tp1ep1pp1")
    ap.add_argument("--engine", default="vllm", choices=("vllm", "hf"))
    add_run_args(ap)
    a = ap.parse_args(argv)
    rc = run_config_from_args(a, ap.prog)
    if a.model:
        from ..checks.layouts import resolve_models

        models = resolve_models(a.model)
    else:
        from ..models import get_model

        models = [str(get_model("qwen3_moe", "medium"))]
    layouts = [l.strip() for l in a.layouts.split(",") if l.strip()]
    with tempfile.TemporaryDirectory() as d:
        res = replay_check.run(models, ",".join(layouts), Path(d), engine=a.engine,
                               overhead_batches=3 if a.engine == "vllm" else 0, timing=3, rc=rc)
        roll = torch.load(Path(d) / "rollout.pt", weights_only=False)
    first = res[layouts[0]][models[0]]
    p = first["padded"]
    cap = roll[models[0]].get("capture") or {}
    result = summarize(res, models, layouts, rc.dtype)
    result.update({"disagreement_without": p["disagreement_without"], "kl_without": p["kl_without"],
                   "kl_with": p["kl_with"],
                   "kl_ratio": p["kl_without"] / p["kl_with"] if p["kl_with"] > 0 else float("inf"),
                   "capture_overhead": cap.get("capture_overhead"), "bytes_per_token": roll[models[0]]["bytes_per_token"],
                   "replay_step_overhead": first["forward_s"]["with_replay"] / first["forward_s"]["without"] - 1,
                   "models": models, "layouts": layouts, "engine": a.engine,
                   "tps_without": cap.get("tps_without"), "tps_with": cap.get("tps_with")})
    emit(result, a.json)
    return result
