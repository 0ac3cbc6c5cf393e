"""lora: expert LoRA layout invariance and PEFT export (tiny models), step time vs the base (medium model).

    python -m moe_lora_rl.bench lora --json [--model DIR ...] [--speed-model DIR] [--layouts ...] [--rank 16]

layout_max_diff: max over layouts/models of |loss| and |adapter| differences after 3 steps vs tp1ep1pp1, on a batch
with an empty and an odd-loaded expert in one MoE layer (empty_expert: per model, False where its routers spread every
batch tried, checks/data.py: the batch with the least-loaded expert is used).
--controls: per layout and model, the negative controls on the adapters loaded from tp1ep1pp1: max |logit diff|
against the reference with one target's adapters dropped ("drop:TARGET", every target the model has) or one factor
perturbed ("perturb:TARGET"); control_min is the smallest, which must exceed the logit tolerance.
peft_max_diff: the trained adapters exported to PEFT, loaded into HF transformers + peft: max |logit diff| vs
Megatron+LoRA. Step times: base = full fine-tuning step (fwd+bwd+AdamW over all weights), LoRA = frozen base +
adapters (fwd+bwd+grad sync+AdamW over adapters), interleaved in one process; fwd_time_ratio isolates the adapters'
forward cost.
Memory (same model and layout, one fresh process per variant, bench/workers/lora_steps_worker.py): base_peak_mb /
lora_peak_mb are the kernel's resident-set high-water mark (ru_maxrss) over 2 training steps minus the process's RSS
before the model was built: model state + grads + optimizer state + activations. peak_ratio = lora / base,
target <= 0.7.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ..checks import lora_layouts
from ..checks.torchrun import run_torchrun, worker_arg
from ..checks.layouts import DEFAULT_LAYOUTS, check_layouts, resolve_models
from ..checks.tolerances import LORA_LOGITS, PEAK_RATIO_TARGET
from ..lora import LoRAConfig
from .emit import emit
from .run_args import add_run_args, run_config_from_args


def measure_memory(model: str, layout: str, cfg: LoRAConfig, rc=None) -> dict:
    """Peak RSS of full fine-tuning vs LoRA training steps, each variant in its own torchrun launch."""
    from ..megatron.layout import Layout
    from ..megatron.run_config import RunConfig

    world = Layout.parse(layout).min_world_size
    got = {v: run_torchrun("moe_lora_rl.bench.workers.lora_steps_worker", world,
                           ["--model", model, "--layout", layout, "--measure", "memory", "--variant", v, "--lora", json.dumps(cfg.to_dict()),
                            *worker_arg(rc or RunConfig())])
           for v in ("base", "lora")}
    return {"base_peak_mb": round(got["base"]["peak_mb"], 1), "lora_peak_mb": round(got["lora"]["peak_mb"], 1),
            "peak_ratio": got["lora"]["peak_mb"] / got["base"]["peak_mb"], "peak_ratio_target": PEAK_RATIO_TARGET,
            "base_step_mb": round(got["base"]["step_mb"], 1), "lora_step_mb": round(got["lora"]["step_mb"], 1),
            "memory_measured_by": "ru_maxrss high-water (reset after load: "
                                  f"{got['base']['hwm_reset'] and got['lora']['hwm_reset']}) minus RSS before build"}


def run(models: list[str], speed_model: str | None, layouts: str, cfg: LoRAConfig, speed_layout: str,
        memory: bool = True, rc=None, controls: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        rep = lora_layouts.run(models, layouts, cfg, work, rc=rc, controls=controls)
        pdiff = {m: lora_layouts.peft_diff(m, work / f"{lora_layouts.REFERENCE}-m{i}.pt", cfg, work / f"peft-m{i}")
                 for i, m in enumerate(models)}
    result = {"layout_max_diff": rep["layout_max_diff"], "peft_max_diff": max(pdiff.values())}
    if speed_model:
        from ..megatron.layout import Layout
        from ..megatron.run_config import RunConfig

        sp = run_torchrun("moe_lora_rl.bench.workers.lora_steps_worker", Layout.parse(speed_layout).min_world_size,
                          ["--model", speed_model, "--measure", "speed", "--layout", speed_layout, "--lora", json.dumps(cfg.to_dict()),
                           *worker_arg(rc or RunConfig())])
        result.update({k: sp[k] for k in ("base_step_s", "lora_step_s", "step_time_ratio", "base_fwd_s",
                                          "lora_fwd_s", "fwd_time_ratio")})
        result["adapter_params"], result["base_params"] = sp["adapter_params_local"], sp["base_params_local"]
        if memory:
            result.update(measure_memory(speed_model, speed_layout, cfg, rc))
        result["speed_model"], result["speed_layout"] = speed_model, speed_layout
    result.update({"models": models, "layouts": layouts.split(","), "rank": cfg.rank,
                   "adapter_layout": cfg.adapter_layout, "per_model_peft_diff": pdiff,
                   "empty_expert": {m: i["empty"] for m, i in rep["expert_load"].items()},
                   "per_layout": {k: {m: {kk: r[kk] for kk in ("loss_max_diff", "adapter_max_diff")}
                                      for m, r in v.items()} for k, v in rep["per_layout"].items()}})
    if controls:
        result["controls"] = {k: {m: r["controls"] for m, r in v.items() if "controls" in r}
                              for k, v in rep["per_layout"].items() if k != lora_layouts.REFERENCE}
        result["control_min"] = min(x for v in result["controls"].values() for c in v.values() for x in c.values())
        result["logits_target"] = LORA_LOGITS
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench lora", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", action="append", help="HF checkpoint(s) for the diffs; default: both tiny GQA models")
    ap.add_argument("--controls", action="store_true", help="negative controls per layout (a target dropped, a "
                    "factor perturbed)")
    ap.add_argument("--speed-model", default=None, help="checkpoint for step times; default: the medium qwen3_moe")
    ap.add_argument("--no-speed", action="store_true", help="skip the step-time and memory measurements")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS)
    ap.add_argument("--speed-layout", default="tp1ep1pp1")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--adapter-layout", default="per_expert")
    add_run_args(ap)
    a = ap.parse_args(argv)
    rc = run_config_from_args(a, ap.prog)
    if rc.dtype != "fp32" and not a.no_speed:
        import sys

        print(f"{ap.prog}: error: --dtype {rc.dtype} with step times and memory: the full fine-tuning baseline here "
              "has no fp32 main grads (no megatron DDP wrapper); add --no-speed", file=sys.stderr)
        sys.exit(2)
    cfg = LoRAConfig(rank=a.rank, alpha=a.alpha, adapter_layout=a.adapter_layout)
    models = resolve_models(a.model)
    check_layouts(models, a.layouts)                       # every layout is run: refuse bad ones before any process
    speed = None
    if not a.no_speed:
        from ..models import get_model

        speed = a.speed_model or str(get_model("qwen3_moe", "medium"))
        if len(check_layouts([speed], a.speed_layout)) != 1:
            raise ValueError(f"--speed-layout {a.speed_layout!r}: give one layout")
    result = run(models, speed, a.layouts, cfg, a.speed_layout, memory=not a.no_memory, rc=rc, controls=a.controls)
    result["dtype"] = rc.dtype
    emit(result, a.json)
    return result
