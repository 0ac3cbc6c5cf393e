"""A run's summary (summary.json) from its per-step records, and the response-length percentiles its records and
summary carry; rl/run.py's GRPORun.summary calls run_summary."""
from __future__ import annotations

import math
from pathlib import Path

from ..mismatch import LOW_TAIL_KEYS
from .samples import _numel


def run_summary(run, history: list[dict], evals: dict, wall: float) -> dict:
    def mean(key, rows):
        vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]   # a skipped step's grad norm
        return sum(vals) / len(vals) if vals else None

    k = min(5, len(history))
    by_len = {f"{name}_{tag}": mean(f"{pre}{name}", history) for tag, pre in (("r3", "r3_"), ("no_r3", "no_r3_"))
              for name in ("seq_ratio_gt2", "seq_log_ratio_max", "kl_first_half", "kl_second_half")}
    cfg = run.cfg
    return {"wall_s": wall, **run.warmup, "setup_s": run.setup_s,
            **run.start_lens, "s_per_step": (wall - run.eval_s) / max(1, len(history)),
            "response_len_mean": mean("response_len", history), **by_len,
            **{f"{k}_s_per_step": mean(f"time_{k}_s", history) for k in ("rollout", "train", "push")},
            "free_disagreement_first_half": mean("free_disagreement_first_half", history),
            "free_disagreement_second_half": mean("free_disagreement_second_half", history),
            "reward_start": mean("reward", history[:k]), "reward_end": mean("reward", history[-k:]),
            "eval_start": evals[0], "eval_end": evals[max(evals)], "evals": evals,
            "kl_mean_r3": mean("r3_kl", history), "kl_mean_no_r3": mean("no_r3_kl", history),
            "ratio_gt2": mean("r3_ratio_gt2", history), "ratio_gt5": mean("r3_ratio_gt5", history),
            **{k: mean(f"r3_{k}", history) for k in LOW_TAIL_KEYS},
            "ratio_gt2_no_r3": mean("no_r3_ratio_gt2", history),
            "ratio_gt5_no_r3": mean("no_r3_ratio_gt5", history),
            "disagreement_mean": mean("disagreement", history),
            "token_disagreement_mean": mean("token_disagreement", history),
            "free_disagreement_mean": mean("free_disagreement", history),
            "free_token_disagreement_mean": mean("free_token_disagreement", history),
            "grad_norm_mean": mean("grad_norm", history), "clipfrac_mean": mean("pg_clipfrac", history),
            "refit_bytes_per_step": mean("refit_bytes", history),
            "full_bytes": full_bytes(run.path, cfg.runtime.rollout_dtype),
            "rollout_busy_frac": run.busy["rollout"] / wall, "train_busy_frac": run.busy["train"] / wall,
            "steps": len(history), "mode": cfg.mode, "eval_s": run.eval_s,
            "engine_restarts": run.engine_restarts, "replay": cfg.replay, "serving": cfg.serving,
            "layout": cfg.layout.layout().name, "model": str(run.path), **base_syncs(run), **occupancy(run),
            **by_source(history, getattr(run, "start_sources", {}), mean, k)}


def by_source(history: list[dict], start: dict, mean, k: int) -> dict:
    """A dataset mixing data sources: each source's reward at the start and the end (the first and last k steps)
    and held-out success at the start and the end ({"by_source": {SOURCE: {...}}}); {} for one source."""
    from .metrics import BY_SOURCE, EVAL_SUCCESS, REWARD

    rp, ep = BY_SOURCE[REWARD], BY_SOURCE[EVAL_SUCCESS]
    sources = sorted({key[len(p):] for r in [start, *history] for key in r for p in (rp, ep) if key.startswith(p)})
    if not sources:
        return {}
    out = {}
    for src in sources:
        evals = [r[ep + src] for r in history if ep + src in r]
        out[src] = {"reward_start": mean(rp + src, history[:k]), "reward_end": mean(rp + src, history[-k:]),
                    "eval_start": start.get(ep + src), "eval_end": evals[-1] if evals else start.get(ep + src)}
    return {"by_source": out}


def occupancy(run) -> dict:
    """Rank 0: the engines' mean running sequences per engine step over the training rollouts (rl/producer.py)."""
    prod = getattr(run, "prod", None)
    if prod is None or getattr(prod, "engines", None) is None:
        return {}
    # how the adapters reach the engines: shm on rank 0's host, http on another node (rollout/placement.py)
    return {**prod.occupancy(), "push_transports": sorted({e.placement.transport for e in prod.engines})}


def base_syncs(run) -> dict:
    """rollout.base_from=trainer or peer, rank 0: how many times the base was sent to an engine (every start and
    restart of every engine), the seconds of the first, how many came from a peer engine, and the transports used."""
    engines = getattr(run.prod, "engines", None)
    if run.cfg.rollout.base_from == "disk" or engines is None:
        return {}
    syncs = [t for e in engines for t in e.base_syncs]
    return {"base_syncs": len(syncs), "base_sync_s": syncs[0]["total_s"] if syncs else None,
            "base_sync_bytes": syncs[0]["bytes"] if syncs else None,
            "base_peer_syncs": sum("peer_port" in t for t in syncs),
            "base_transports": sorted({t.get("transport", "shm") for t in syncs})}


def full_bytes(path, rollout_dtype: str) -> int:
    """What a full-weight refit would send: every parameter of the checkpoint at the serving dtype."""
    from safetensors import safe_open

    per = 2 if rollout_dtype == "bfloat16" else 4
    n = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            n += sum(_numel(h.get_slice(k).get_shape()) for k in h.keys())
    return n * per


def length_percentiles(lens: list[int], prefix: str) -> dict:
    """{prefix}p10, p50, p90 and max of response lengths in tokens (nearest rank; {} for none)."""
    if not lens:
        return {}
    s = sorted(lens)
    return {**{f"{prefix}p{q}": s[min(len(s) - 1, q * len(s) // 100)] for q in (10, 50, 90)}, f"{prefix}max": s[-1]}
