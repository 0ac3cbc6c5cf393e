"""bench sparse's runs: the settings, each run's overrides (dense, Sparse-RL uncorrected / corrected, replayed
eviction), --runs and --evict read, the KV worker's figures (bench/workers/sparse_kv_worker.py, dense then
compressed) and their summary, and the summary of a partial set of runs."""
from __future__ import annotations

import json
from pathlib import Path

from .kept_runs import with_warm_start
from .peer_task import TRACE_OVERRIDES

TASK = [*TRACE_OVERRIDES, "steps=30", "eval_every=10"]
"""The long task's run: every held-out problem once per evaluation; responses of up to 96 tokens (the trace of 10
digits and its end-of-turn take 85)."""
SETTINGS = {"sort_trace": TASK, "long": ["--config-name=long", "eval_every=10", "algo.lr=3e-4"]}
WARM = {"long": ["model.warm_steps=500"]}
"""The setting's warm start where no --model (or model.warm_* override) is given: the long recipe's 300 supervised
steps leave held-out success at 0.008, nothing for GRPO to learn from; 500 give 0.37-0.40. From there the recipe's
lr 1e-3 degrades the policy (0.398 -> 0.234 in 40 steps) and 3e-4 keeps it (docs/long_reasoning.md)."""
RUNS = ("dense", "sparse_uncorrected", "sparse_corrected", "sparse_replay")
REPLAYS = ("snapkv",)
"""--method values whose eviction the trainer can replay (rollout.kv_replay): the sparse_replay run; the others
skip it."""


def run_overrides(run: str, method: str, budget: int, evict: dict | None = None) -> list[str]:
    kv = [f"rollout.kv_compression={method}", f"rollout.kv_budget={budget}",
          *(f"rollout.kv_evict.{k}={v}" for k, v in sorted((evict or {}).items()))]
    return {"dense": [], "sparse_uncorrected": [*kv, "algo.rollout_is=off"],
            "sparse_corrected": [*kv, "algo.rollout_is=sparse"],
            "sparse_replay": [*kv, "rollout.kv_replay=true", "algo.rollout_is=sparse"]}[run]


def setting_overrides(setting: str, extra: list[str], model_over: list[str]) -> list[str]:
    """The setting's overrides (before the user's, which win), with its WARM start unless --model (model_over) or a
    model.warm_* override chooses the model."""
    return with_warm_start(SETTINGS[setting], WARM.get(setting, []), extra, model_over)


def pick_runs(spec: str | None, runs: tuple[str, ...]) -> tuple[str, ...]:
    """--runs: a subset of the method's runs (ValueError naming one it does not have)."""
    if spec is None:
        return runs
    chosen = tuple(filter(None, spec.split(",")))
    bad = [r for r in chosen if r not in runs]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"--runs={spec!r}: expected distinct runs of {list(runs)}")
    return chosen


def runs_of(method: str) -> tuple[str, ...]:
    return RUNS if method in REPLAYS else RUNS[:3]


def evict_spec(spec: str) -> dict:
    """'recent=16,interval=8' -> {"recent": 16, "interval": 8} (ValueError naming a malformed item)."""
    out = {}
    for item in filter(None, spec.split(",")):
        k, _, v = item.partition("=")
        if not v.strip().isdigit():
            raise ValueError(f"--evict item {item!r}: expected key=integer")
        out[k.strip()] = int(v)
    return out


def kv_figures(model: str, a, evict: dict, cfg, root: Path) -> dict:
    """The KV worker (bench/workers/sparse_kv_worker.py) dense, then compressed at the dense engine's concurrency too;
    cfg: the dense run's config."""
    from ...checks.torchrun import run_process

    length = cfg.data.length if cfg.data.task == "sort_trace" else 10      # prompts; answers are forced
    common = ["--model", model, "--pool-blocks", str(a.pool_blocks), "--length", str(length),
              "--requests", str(a.kv_requests),
              "--max-tokens", str(cfg.algo.max_response_tokens)]
    dense = run_process("moe_lora_rl.bench.workers.sparse_kv_worker", [*common, "--method", "none", "--budget", "0"],
                        cwd=root, what="KV worker")
    sparse = run_process("moe_lora_rl.bench.workers.sparse_kv_worker",
                         [*common, "--method", a.method, "--budget", str(a.budget),
                          "--at-cap", str(max(1, dense["concurrency"])),
                          *(["--evict", json.dumps(evict)] if a.method == "snapkv" else [])],
                         cwd=root, what="KV worker")
    return {"none": dense, "sparse": sparse}


def kv_summary(kv: dict) -> dict:
    """The KV worker's figures: sequences served at once on the pool, and blocks per sequence at the same
    concurrency (the dense engine's), time-averaged and at the peak."""
    d, s = kv["none"], kv["sparse"]
    same = s["at_cap"] or {}
    dc = d["at_concurrency"] or {}
    return {"concurrency_ratio": s["concurrency"] / d["concurrency"] if d["concurrency"] else None,
            "concurrency": {"dense": d["concurrency"], "sparse": s["concurrency"], "pool_blocks": d["pool_blocks"],
                            "tokens_per_s_dense": dc.get("tokens_per_s"),
                            "tokens_per_s_sparse": (s["at_concurrency"] or {}).get("tokens_per_s"),
                            "peak_blocks_per_seq_dense": d["kv"]["peak_blocks_per_seq"],
                            "peak_blocks_per_seq_sparse": s["kv"]["peak_blocks_per_seq"]},
            "same_concurrency": {"cap": dc.get("cap"),
                                 "blocks_per_seq_dense": dc.get("blocks_per_seq_mean"),
                                 "blocks_per_seq_sparse": same.get("blocks_per_seq_mean"),
                                 "peak_blocks_per_seq_dense": dc.get("blocks_per_seq_peak"),
                                 "peak_blocks_per_seq_sparse": same.get("blocks_per_seq_peak"),
                                 "mean_ratio": same.get("blocks_per_seq_mean", 0) / dc["blocks_per_seq_mean"]
                                 if dc.get("blocks_per_seq_mean") else None,
                                 "peak_ratio": same.get("blocks_per_seq_peak", 0) / dc["blocks_per_seq_peak"]
                                 if dc.get("blocks_per_seq_peak") else None,
                                 "tokens_per_s_dense": dc.get("tokens_per_s"),
                                 "tokens_per_s_sparse": same.get("tokens_per_s")},
            "evictions": s.get("evictions")}


def mean_of(rows: list[dict], key: str):
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None


def partial_summary(sums: dict, a, seeds: list[int], runs: tuple[str, ...], wall_s: float) -> dict:
    """--runs with --out, too few runs for the summary: each run's held-out success (its own sampler's, and on a
    dense engine), and the runs a later --reuse still needs."""
    done = {f"{r}-s{s}": {"eval_start": v.get("eval_start"), "eval_end": v.get("eval_end"),
                          "eval_end_dense": v.get("eval_end_dense")} for (r, s), v in sorted(sums.items())}
    return {"method": a.method, "budget": a.budget, "setting": a.setting, "partial": True, "done": done,
            "missing": [f"{r}-s{s}" for s in seeds for r in runs if (r, s) not in sums], "out": a.out,
            "bench_wall_s": round(wall_s, 1)}
