"""`moe-lora-rl plan --sync MODE`: the full-weight sync calculator (plan/sync_calc.py) from the command line: the
model's base to every rollout GPU of --gpus, by broadcast and/or shard-aware transfer, with checkpoint-engine's
published figures beside the calculator's predictions."""
from __future__ import annotations

import dataclasses
import math

from ..plan.sync_calc import GB, Links, model_bytes, published_check, spec, sync_time

SYNC_ARGS = {"sync", "sync_dtype", "engine_gpus", "model", "gpus", "json", "memory_gb", "link_gbps", "nvlink_gbps",
             "apply_gbps"}


def engine_gpus(model: str, dtype: str, memory_gb: float, given: int | None) -> int:
    """--engine-gpus, or the smallest power of two whose GPUs hold the weights in 90% of their memory."""
    if given is not None:
        if given < 1:
            raise ValueError(f"--engine-gpus={given}: must be >= 1")
        return given
    need = model_bytes(spec(model), dtype)["total"] / (0.9 * memory_gb * GB)
    return 1 << max(0, math.ceil(math.log2(need)))


def run_sync(a) -> dict:
    links = Links()
    for flag, field in (("link_gbps", "nic_gbps"), ("nvlink_gbps", "nvlink_gbps"), ("apply_gbps", "apply_gbps")):
        v = getattr(a, flag)
        if v is not None:
            if v <= 0:
                raise ValueError(f"--{flag.replace('_', '-')}={v}: must be > 0")
            links = dataclasses.replace(links, **{field: v})
    memory = 80.0 if a.memory_gb is None else a.memory_gb
    eg = engine_gpus(a.model, a.sync_dtype, memory, a.engine_gpus)
    if a.gpus % eg:
        raise ValueError(f"--gpus={a.gpus}: engines of {eg} GPUs each ({a.model} {a.sync_dtype}); give a multiple")
    modes = ("broadcast", "shard") if a.sync == "both" else (a.sync,)
    out = {"model": a.model, "dtype": a.sync_dtype, "gpus": a.gpus, "engine_gpus": eg,
           "links": dataclasses.asdict(links), "published": published_check(links)}
    for m in modes:
        out[m] = sync_time(spec(a.model), a.sync_dtype, eg, instances=a.gpus // eg, mode=m, links=links)
    return out


def sync_table(d: dict) -> str:
    lk = d["links"]
    rows = [("model", f"{d['model']} {d['dtype']} on {d['gpus']} GPUs: engines of {d['engine_gpus']} GPUs"),
            ("links", f"NVLink {lk['nvlink_gbps']:g} GB/s, NIC {lk['nic_gbps']:g} GB/s per GPU, apply "
                      f"{lk['apply_gbps']:g} GB/s, fixed {lk['fixed_s']:g} s + {lk['bucket_s'] * 1e3:g} ms/bucket")]
    for m in ("broadcast", "shard"):
        if m in d:
            r = d[m]
            rows.append((m, f"{r['seconds']:.2f} s: {r['received_gb']:.1f} GB into each GPU, {r['sent_gb']:.1f} GB "
                            f"out of each sender, {r['buckets']} buckets of {r['bucket_gib']:.1f} GiB"))
    for p in d["published"]["rows"]:
        rows.append(("published", f"{p['what']}: {p['seconds']:g} s, predicted {p['predicted_s']:.2f} s "
                                  f"({p['error']:+.0%})"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
