"""`moe-lora-rl plan` / `python -m moe_lora_rl.plan`: the layout planner's command line (table or --json).
With --host-cores/--rollout-s/--train-s it prints the shared-host CPU prediction (shared_host.py) instead."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from .search import Plan, plan
from .lengths import parse_lengths
from .shared_host import HostLengths, HostPhases, predict, predict_policies
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
    r.add_argument("--batch", type=int, help=f"samples per optimizer step (default {d.batch}; shared host: the "
                   "engine's batch, needed with --lengths)")
    r.add_argument("--prompt-len", type=int, default=d.prompt_len)
    r.add_argument("--response-len", type=int, default=d.response_len)
    r.add_argument("--rank", type=int, default=d.rank)
    r.add_argument("--adapter-layout", default=d.adapter_layout, choices=("per_expert", "shared_outer", "shared"))
    r.add_argument("--mode", default=d.mode, choices=("sync", "async"))
    r.add_argument("--max-staleness", "--staleness", dest="staleness", type=int, default=d.staleness,
                   help="max pushes a sample may lag (default: the run config's max_staleness, 1)")
    r.add_argument("--lengths", metavar="DIST", help="response-length distribution: a length (4096), a lognormal "
                   "fitted to two of mean/pNN (mean=4096,p99=16384), or a mix LENGTH:WEIGHT,... (512:0.8,8192:0.2); "
                   "clipped at --response-len, the cap memory is sized for (default: every answer --response-len)")
    r.add_argument("--ahead", type=int, help="async: updates the producer admits ahead of the pushes (default: "
                   "the staleness bound, as the run's gate)")
    r.add_argument("--micro-batch", type=int, default=d.micro_batch)
    r.add_argument("--no-recompute", action="store_true", help="keep all activations (no full recomputation)")
    r.add_argument("--max-engine-concurrency", type=int, default=d.max_engine_concurrency)
    r.add_argument("--train-weight-bytes", type=float, help="bytes per frozen base parameter in training "
                   "(default: the checkpoint's dtype)")
    r.add_argument("--rollout-weight-bytes", type=float, help="bytes per base parameter in the engines")
    h = ap.add_argument_group("shared host (CPU: rollout engine and trainer on one host's cores; replaces the GPU "
                              "plan, --staleness is the bound k)")
    h.add_argument("--host-cores", metavar="C", help="cores the rollout engine and the trainer share")
    h.add_argument("--rollout-s", metavar="R1,RC", help="rollout seconds per step on 1 core and on all C cores")
    h.add_argument("--train-s", metavar="T1,TC", help="training seconds per step on 1 core and on all C cores")
    h.add_argument("--refit-s", metavar="X", help="adapter push seconds per step (default 0)")
    h.add_argument("--decode-fixed", metavar="PHI", type=float, default=1.0, help="with --lengths: share of a "
                   "full-batch decode step that does not shrink with the batch (1: memory-bound, the default)")
    h.add_argument("--engine-frac", metavar="E", type=float, default=1.0, help="with --lengths: share of the "
                   "rollout seconds spent in the engine's decode steps (1, the default: all of them)")
    h.add_argument("--policies", type=int, default=1, help="N policies on one base and engine (the run config's "
                   "`policies`): their wall time together vs each run alone, one after the other")
    h.add_argument("--steps", type=int, default=80, help="with --policies: steps per policy")
    h.add_argument("--setup-s", type=float, default=0.0, help="with --policies: a job's seconds before its RL loop")
    h.add_argument("--eval-s", type=float, default=0.0, help="with --policies: a policy's evaluation seconds")
    y = ap.add_argument_group("full-weight sync (the base to every rollout GPU; replaces the layout plan)")
    y.add_argument("--sync", choices=("broadcast", "shard", "both"), help="predict the sync time of --model's "
                   "base on --gpus rollout GPUs (presets: kimi-k2, deepseek-v3, qwen3-235b-a22b, qwen3-30b-a3b)")
    y.add_argument("--sync-dtype", default="bf16", choices=("bf16", "fp8"))
    y.add_argument("--engine-gpus", type=int, help="GPUs per engine (default: the fewest, a power of two, that "
                   "hold the weights in 90%% of --memory-gb)")
    y.add_argument("--nvlink-gbps", type=float, help="NCCL broadcast bandwidth inside a node (default 150)")
    y.add_argument("--apply-gbps", type=float, help="an engine's weight-loading rate per GPU (default: fitted)")
    return ap


_HOST_FLAGS = ("host_cores", "rollout_s", "train_s", "refit_s")
# HostPhases field (as its ValueError names it) -> the flag it came from
_HOST_FIELD_FLAG = {"rollout_1": "--rollout-s", "rollout_c": "--rollout-s", "train_1": "--train-s",
                    "train_c": "--train-s", "refit": "--refit-s", "cores": "--host-cores"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _seconds(name: str, text: str, n: int) -> list[float]:
    parts = text.split(",")
    try:
        if len(parts) != n:
            raise ValueError
        return [float(x) for x in parts]
    except ValueError:
        want = "ONE_CORE,ALL_CORES seconds, e.g. 10.1,11.4" if n == 2 else "seconds, e.g. 0.5"
        raise ValueError(f"{_flag(name)}={text!r}: expected {want}") from None


def host_phases(a: argparse.Namespace) -> HostPhases:
    """The shared-host flags as HostPhases; a partial set is refused naming what is missing."""
    missing = [_flag(k) for k in _HOST_FLAGS[:3] if getattr(a, k) is None]
    if missing:
        given = [_flag(k) for k in _HOST_FLAGS if getattr(a, k) is not None]
        raise ValueError(f"shared-host prediction ({', '.join(given)} given) needs --host-cores, --rollout-s and "
                         f"--train-s; missing {', '.join(missing)}")
    try:
        cores = int(a.host_cores)
    except ValueError:
        raise ValueError(f"--host-cores={a.host_cores!r}: expected an integer >= 1") from None
    r1, rc = _seconds("rollout_s", a.rollout_s, 2)
    t1, tc = _seconds("train_s", a.train_s, 2)
    refit = _seconds("refit_s", a.refit_s, 1)[0] if a.refit_s is not None else 0.0
    try:
        return HostPhases(rollout_1=r1, rollout_c=rc, train_1=t1, train_c=tc, cores=cores, refit=refit)
    except ValueError as e:
        raise ValueError(f"{_HOST_FIELD_FLAG.get(str(e).split('=')[0], 'shared host')}: {e}") from None


def host_lengths(a: argparse.Namespace) -> HostLengths | None:
    if a.ahead is not None and not 1 <= a.ahead <= max(a.staleness, 0):
        raise ValueError(f"--ahead={a.ahead}: the staleness bound {a.staleness} cannot hold groups admitted "
                         f"{a.ahead} updates ahead (use 1 <= --ahead <= --max-staleness)")
    if a.lengths is None:
        return None
    if a.batch is None:
        raise ValueError(f"--lengths={a.lengths!r} on the shared host needs --batch (answers the engine runs at once)")
    try:
        return HostLengths(parse_lengths(a.lengths, a.response_len), a.batch, a.decode_fixed, a.engine_frac)
    except ValueError as e:
        raise ValueError(f"--lengths: {e}") from None


def run_shared_host(a: argparse.Namespace) -> dict:
    ph = host_phases(a)
    ln = host_lengths(a)
    try:
        pred = predict(ph, a.staleness, ln)
    except ValueError as e:
        raise ValueError(f"--staleness: {e}") from None
    d = {"shared_host": asdict(ph), "max_staleness": a.staleness, **pred}
    if a.policies != 1:
        try:
            d["policies"] = {"n": a.policies, "steps": a.steps,
                             **predict_policies(ph, a.policies, a.steps, a.setup_s, a.eval_s)}
        except ValueError as e:
            raise ValueError(f"--{str(e).split('=')[0].replace('_', '-')}: {e}") from None
    if ln:
        d["lengths"] = {"spec": a.lengths, "mean": ln.dist.mean, "batch": ln.batch, "decode_fixed": ln.fixed_frac,
                        "engine_frac": ln.engine_frac, "expected_longest_of_batch": ln.dist.expected_max(ln.batch),
                        "occupancy_sync": ln.occupancy_sync()}
    if a.json:
        sys.stdout.write(json.dumps(d) + "\n")
    else:
        print(host_table(d))
    return d


def host_table(d: dict) -> str:
    h = d["shared_host"]
    rows = [
        ("host", f"{h['cores']} cores shared by the rollout engine and the trainer, "
                 f"max staleness {d['max_staleness']}"),
        ("phases (s)", f"rollout {h['rollout_1']:g} on 1 core, {h['rollout_c']:g} on {h['cores']}; train "
                       f"{h['train_1']:g} on 1 core, {h['train_c']:g} on {h['cores']}; refit {h['refit']:g}"),
        ("step (s)", f"sync {d['sync_step_s']:.3g}, async {d['async_step_s']:.3g} (bound by {d['limit']})"),
        ("steps/min", f"sync {d['sync_steps_per_min']:.3g}, async {d['async_steps_per_min']:.3g}"),
        ("speedup", f"predicted {d['predicted_speedup']:.3g}, overlap bound {d['overlap_bound']:.3g}"),
        ("staleness", f"implied max {d['implied_staleness']} vs bound {d['max_staleness']}"),
    ]
    if "policies" in d:
        p = d["policies"]
        rows.append(("policies", f"{p['n']} x {p['steps']} steps together {p['together_s']:.4g} s vs apart "
                                 f"{p['apart_s']:.4g} s: predicted {p['predicted_speedup']:.3g}x (RL loop "
                                 f"{p['predicted_speedup_loop']:.3g}x; a turn {p['turn_s']:.3g} s, bound by "
                                 f"{p['limit']})"))
    if "lengths" in d:
        ln = d["lengths"]
        rows[2:2] = [("lengths", f"{ln['spec']}: mean {ln['mean']:.0f}, expected longest of {ln['batch']} "
                                 f"{ln['expected_longest_of_batch']:.0f}; async rollout x{d['async_rollout_factor']:.3g}"
                                 f" of sync (decode step fixed share {ln['decode_fixed']:g}, engine share "
                                 f"{ln['engine_frac']:g}); sync occupancy {ln['occupancy_sync']:.3g} of {ln['batch']}")]
        rows.append(("tokens/s", f"produced {d['produced_tokens_per_s']:.3g} (engine alone, async), consumed "
                                 f"{d['consumed_tokens_per_s']:.3g} (trainer alone)"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def run(argv=None) -> Plan | dict:
    a = parser().parse_args(argv)
    if a.sync is not None:
        from .sync_plan import SYNC_ARGS, run_sync, sync_table

        defaults = parser().parse_args([])
        other = [k for k, v in vars(a).items() if k not in SYNC_ARGS and v != getattr(defaults, k)]
        if other:
            raise ValueError(f"--{other[0].replace('_', '-')} does not apply to --sync (it takes --model, --gpus, "
                             "--sync-dtype, --engine-gpus, --memory-gb, --link-gbps, --nvlink-gbps, --apply-gbps)")

        d = run_sync(a)
        sys.stdout.write(json.dumps(d) + "\n" if a.json else sync_table(d) + "\n")
        return d
    if any(getattr(a, k) is not None for k in _HOST_FLAGS):
        return run_shared_host(a)
    if a.policies != 1:
        raise ValueError(f"--policies={a.policies}: predicted on the shared host (give --host-cores, --rollout-s and "
                         "--train-s)")
    hw = load_hardware(a.hardware_json, **{v: getattr(a, k) for k, v in _HW.items()})
    rl = RLSettings(batch=RLSettings.batch if a.batch is None else a.batch, prompt_len=a.prompt_len,
                    response_len=a.response_len, rank=a.rank, lengths=a.lengths, ahead=a.ahead,
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
    ln, st = p.lengths, p.staleness
    rows = [
        ("model", f"{p.model} on {p.gpus} GPUs x {p.hardware['memory_GB']:g} GB ({p.hardware['source']})"),
        ("settings", f"batch {s['batch']} samples of {s['prompt_len']}+{s['response_len']} tokens, mode {s['mode']}, "
                     f"staleness bound {s['staleness']}"),
        ("adapters", f"{a['layout']} r{a['rank']}: {a['params'] / 1e9:.1f}B params, {a['bytes'] / 1e9:.1f} GB bf16, "
                     f"refit {a['refit_s']:.2f} s at {p.hardware['link_GBps']:g} GB/s"),
        ("  by target", ", ".join(f"{k} {v / 1e9:.3g}" for k, v in a["target_bytes"].items()) + " GB"),
        ("training", f"{t['gpus']} GPUs tp{t['tp']} etp{t['etp']} ep{t['ep']} pp{t['pp']} dp{t['dp']}, "
                     f"{t['microbatches_per_replica']} microbatches/replica"),
        ("  memory/GPU", _mem(t["memory_GB"])),
        ("rollout", f"{r['gpus']} GPUs: {r['engines']} engine(s) x {r['engine_gpus']} GPUs (tp{r['tp']} ep{r['ep']}, "
                    f"attention dp{r['attention_dp']}), concurrency {r['concurrency_per_engine']}/engine "
                    f"(sync {r['concurrency_sync']}, async {r['concurrency_async']})"),
        ("  memory/GPU", _mem(r["memory_GB"])),
        ("  cache/seq", f"KV {r['kv_bytes_per_token'] / 1024:.3g} KiB/token"
         + (f" ({r['linear_layers']} delta-net layers keep none), recurrent state "
            f"{r['state_bytes_per_seq'] / 2**20:.3g} MiB/sequence" if r["linear_layers"] else "")),
        ("rates", f"production {p.rates['production_samples_per_s']:.3g} samples/s, consumption "
                  f"{p.rates['consumption_samples_per_s']:.3g} samples/s (ratio "
                  f"{p.rates['production_over_consumption']:.2f})"),
        ("lengths", f"{ln['spec']}: mean {ln['mean']:.0f} tokens, expected longest of a batch "
                    f"{ln['expected_longest_of_batch']:.0f} (cap {ln['cap']})"),
        ("tokens/s", f"produced {p.rates['produced_tokens_per_s']:.3g} (async, slots full; sync "
                     f"{p.rates['produced_tokens_per_s_sync']:.3g} while generating), consumed "
                     f"{p.rates['consumed_tokens_per_s']:.3g}"),
        ("staleness", f"implied max {st['implied_max']} vs bound {st['bound']} (admitted {st['ahead']} updates "
                      "ahead)" if s["mode"] == "async" else f"0 (sync; bound {st['bound']})"),
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
