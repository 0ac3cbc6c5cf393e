"""`moe-lora-rl plan` / `python -m moe_lora_rl.plan`: the layout planner's command line (table or --json)."""
from __future__ import annotations

import argparse
import json
import sys

from .search import Plan, plan
from .specs import PRESETS, RLSettings, load_hardware, load_model

_HW = {"memory_gb": "memory_GB", "usable_fraction": "usable_fraction", "bf16_tflops": "bf16_TFLOPs",
       "hbm_gbps": "hbm_GBps", "train_mfu": "train_mfu", "decode_bw_eff": "decode_bw_eff",
       "decode_flops_eff": "decode_flops_eff", "link_gbps": "link_GBps", "gpus_per_node": "gpus_per_node"}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moe-lora-rl plan", description=(
        "Training and rollout layouts, the GPU split that balances rollout production with training consumption "
        "under a staleness bound, and the predicted RL steps/min."))
    ap.add_argument("--model", default="kimi-k2", help=f"preset ({', '.join(PRESETS)}) or an HF checkpoint dir / "
                    "config.json")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    g = ap.add_argument_group("hardware (per GPU; defaults: H100/H800 SXM 80 GB)")
    g.add_argument("--hardware-json", help="figures from a bench JSON (its 'hardware' object), e.g. the output of "
                   "`python -m moe_lora_rl.bench plan --json`")
    g.add_argument("--memory-gb", type=float)
    g.add_argument("--usable-fraction", type=float)
    g.add_argument("--bf16-tflops", type=float)
    g.add_argument("--hbm-gbps", type=float)
    g.add_argument("--train-mfu", type=float)
    g.add_argument("--decode-bw-eff", type=float)
    g.add_argument("--decode-flops-eff", type=float)
    g.add_argument("--link-gbps", type=float, help="trainer -> engine link for the adapter refit (GB/s)")
    g.add_argument("--gpus-per-node", type=int)
    r = ap.add_argument_group("RL and LoRA settings")
    d = RLSettings()
    r.add_argument("--batch", type=int, default=d.batch, help="samples per optimizer step")
    r.add_argument("--prompt-len", type=int, default=d.prompt_len)
    r.add_argument("--response-len", type=int, default=d.response_len)
    r.add_argument("--rank", type=int, default=d.rank)
    r.add_argument("--adapter-layout", default=d.adapter_layout, choices=("per_expert", "shared_outer", "shared"))
    r.add_argument("--mode", default=d.mode, choices=("sync", "async"))
    r.add_argument("--staleness", type=int, default=d.staleness, help="max policy versions a sample may lag")
    r.add_argument("--micro-batch", type=int, default=d.micro_batch)
    r.add_argument("--no-recompute", action="store_true", help="keep all activations (no full recomputation)")
    r.add_argument("--max-engine-concurrency", type=int, default=d.max_engine_concurrency)
    r.add_argument("--train-weight-bytes", type=float, help="bytes per frozen base parameter in training "
                   "(default: the checkpoint's dtype)")
    r.add_argument("--rollout-weight-bytes", type=float, help="bytes per base parameter in the engines")
    return ap


def run(argv=None) -> Plan:
    a = parser().parse_args(argv)
    hw = load_hardware(a.hardware_json, **{v: getattr(a, k) for k, v in _HW.items()})
    rl = RLSettings(batch=a.batch, prompt_len=a.prompt_len, response_len=a.response_len, rank=a.rank,
                    adapter_layout=a.adapter_layout, mode=a.mode, staleness=a.staleness, micro_batch=a.micro_batch,
                    recompute=not a.no_recompute, max_engine_concurrency=a.max_engine_concurrency)
    for name in ("train_weight_bytes", "rollout_weight_bytes"):
        v = getattr(a, name)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={v}: must be > 0")
    p = plan(load_model(a.model), hw, rl, a.gpus, a.train_weight_bytes, a.rollout_weight_bytes)
    if a.json:
        sys.stdout.write(json.dumps(p.to_dict()) + "\n")
    else:
        print(table(p))
    return p


def _mem(d: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in d.items() if k not in ("total", "budget")) + \
        f" = {d['total']:.1f} of {d['budget']:.1f} GB"


def table(p: Plan) -> str:
    s, t, r, a, ts = p.settings, p.training, p.rollout, p.adapter, p.times_s
    rows = [
        ("model", f"{p.model} on {p.gpus} GPUs x {p.hardware['memory_GB']:g} GB ({p.hardware['source']})"),
        ("settings", f"batch {s['batch']} samples of {s['prompt_len']}+{s['response_len']} tokens, mode {s['mode']}, "
                     f"staleness bound {s['staleness']}"),
        ("adapters", f"{a['layout']} r{a['rank']}: {a['params'] / 1e9:.1f}B params, {a['bytes'] / 1e9:.1f} GB bf16, "
                     f"refit {a['refit_s']:.2f} s at {p.hardware['link_GBps']:g} GB/s"),
        ("training", f"{t['gpus']} GPUs tp{t['tp']} etp{t['etp']} ep{t['ep']} pp{t['pp']} dp{t['dp']}, "
                     f"{t['microbatches_per_replica']} microbatches/replica"),
        ("  memory/GPU", _mem(t["memory_GB"])),
        ("rollout", f"{r['gpus']} GPUs: {r['engines']} engine(s) x {r['engine_gpus']} GPUs (tp{r['tp']} ep{r['ep']}, "
                    f"attention dp{r['attention_dp']}), concurrency {r['concurrency_per_engine']}/engine "
                    f"(sync {r['concurrency_sync']}, async {r['concurrency_async']})"),
        ("  memory/GPU", _mem(r["memory_GB"])),
        ("rates", f"production {p.rates['production_samples_per_s']:.3g} samples/s, consumption "
                  f"{p.rates['consumption_samples_per_s']:.3g} samples/s (ratio "
                  f"{p.rates['production_over_consumption']:.2f})"),
        ("step (s)", ", ".join(f"{k.removesuffix('_s')} {v:.3g}" for k, v in ts.items() if k.endswith("_s"))),
        ("steps/min", ", ".join(f"{k} {v:.3g}" for k, v in p.steps_per_min.items())
         + (f" (async max staleness {p.max_staleness})" if p.max_staleness is not None else "")),
        ("binding", ", ".join(f"{k}: {v}" for k, v in p.binding.items())),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(argv=None) -> int:
    try:
        run(argv)
    except ValueError as e:
        print(f"moe-lora-rl plan: error: {e}", file=sys.stderr)
        return 2
    return 0


def console() -> int:
    """Entry point of the `moe-lora-rl` console script: `moe-lora-rl plan ...`."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "plan":
        print("usage: moe-lora-rl plan [options]  (moe-lora-rl plan --help)", file=sys.stderr)
        return 2
    return main(argv[1:])
