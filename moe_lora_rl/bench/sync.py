"""sync: the base model into a rollout engine, from disk against from the trainer (the engine started empty and the
checkpoint sent over shared memory through vLLM's weight-transfer calls: transfer/, vllm/base_sync.py), side by
side in one run, with the calculator's figures at scale.

    python -m moe_lora_rl.bench sync --json [--model DIR] [--bucket-mb 64] [--dtype float32]

Figures (one engine server process each, on this host):
- disk_start_s / trainer_start_s: from launching the engine to serving (health, warm-up), loaded from disk against
  started empty plus the sync (rollout.base_from=trainer's path: RolloutEngine with base_from="trainer");
- sync_s and its phases copy_s (the sender writes the buckets into its shared-memory store, with their digests),
  transport_s (the engine maps each bucket and checks its digest, through the RPCs), load_s (the engine checks the
  bytes again and loads them into the model, the kernels' post-load processing included);
- shm_gbps: the model's bytes over move_s (from start_weight_update to the last bucket's answer: the writes overlap
  the engine's reads; init_s, our backend made the worker's engine once per process, beside it), against memcpy_gbps, one in-memory copy of the same tensors into buffers already allocated, in
  this process (shm_vs_memcpy = their ratio);
- restart_*: the same engine restarted (a fresh process, as after a crash) and synced from the store already
  written: no copy on the sending side (restart_shm_gbps, restart_sync_s, restart_start_s);
- peer_*: two engines (rollout.base_from=peer), one SIGKILLed and restarted while the other generates without a
  pause: the restarted engine takes the base from the live one (bench/runners/sync_peer.py). peer_join_s: from the kill to
  serving (against disk_start_s); peer_tokens_per_s_ratio: the live engine's tokens/s while it gives the base (the
  sync) over its rate before; peer_tokens_per_s_ratio_restart: the same over the whole restart (the new engine's
  own start, which competes for the same cores here, included);
- gloo_*: then the base to both engines at once over one gloo group (transfer/gloo_sender.py) as version 2:
  gloo_broadcast_gbps over gloo_move_s (the broadcasts with their agreements, the store written before), the
  engines' load beside it (gloo_load_s), gloo_served (each engine's served version after it);
- exact: both engines sample the same tokens with the same logprobs (fixed seeds, temperature 1) after the sync,
  and the restarted one too (restart_exact), and the one that joined from its peer (peer_exact);
- calc_error_max and kimi_k2_bf16_128_s: plan/sync_calc.py against checkpoint-engine's published figures, and
  Kimi-K2 bf16 on 128 GPUs shard-aware (calculated, not measured).
- http_*: then the same bytes as version 2 into the restarted engine inline (base_transport=http, each bucket base64
  in its call: the path of an engine on another host), the store written before: http_gbps over http_move_s (the
  encoding, http_encode_s, overlaps the calls), http_vs_shm against restart_shm_gbps, http_exact.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from .emit import emit


def _time_copy(tensors: dict, into: dict) -> float:
    t0 = time.perf_counter()
    for k, v in tensors.items():
        into[k].copy_(v)
    return time.perf_counter() - t0


def _http(eng, tensors: dict, bucket_mb: float, prompts, sample: dict) -> dict:
    """The same bytes again as base version 2, inline (transport http: each bucket base64 in its call, the path of an
    engine on another host), from a store written before the timing; then the engine's samples."""
    from ..transfer.shm_sender import send_store
    from ..transfer.base_store import BaseStore

    store = BaseStore(tensors, int(bucket_mb * (1 << 20)), version=2)
    try:
        for i in range(len(store.buckets)):
            store.data(i)
        t = send_store(eng.transport.call, store, transport="http")
    finally:
        store.close()
    out = eng.generate(prompts, **sample)
    return {"http_sync_s": t["total_s"], "http_move_s": t["move_s"], "http_encode_s": t["copy_s"],
            "http_transport_s": t["transport_s"], "http_load_s": t["load_s"],
            "http_gbps": t["bytes"] / t["move_s"] / 1e9,
            "tokens": [s.response for s in out], "logprobs": [s.logprobs for s in out]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench sync", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in glm4_moe medium)")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = ap.parse_args(argv)
    if not a.bucket_mb > 0:
        raise ValueError(f"--bucket-mb {a.bucket_mb}: must be > 0")
    from ..models import get_model
    from ..rollout.client import RolloutEngine
    from ..plan.sync_calc import kimi_k2_bf16, published_check
    from ..transfer.shm_sender import checkpoint_tensors
    from .runners.sync_peer import peer_join

    model = a.model or str(get_model("glm4_moe", "medium"))
    tensors = checkpoint_tensors(model)                  # refuses a directory without safetensors
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    into = {k: v.clone() for k, v in tensors.items()}
    memcpy_s = min(_time_copy(tensors, into) for _ in range(3))
    del into
    prompts = [[(7 * i + 3 * j) % 500 + 10 for j in range(8 + 3 * i)] for i in range(4)]
    sample = dict(seeds=[11, 12, 13, 14], max_tokens=16, temperature=1.0, stop_token_ids=[])
    runs = {}
    with tempfile.TemporaryDirectory() as d:
        for name, base_from in (("disk", "disk"), ("trainer", "trainer")):
            t0 = time.perf_counter()
            eng = RolloutEngine.start(model, dtype=a.dtype, log_dir=d, prefix_caching=False, capture=False,
                                      base_from=base_from, base_bucket_mb=a.bucket_mb)
            try:
                start_s = time.perf_counter() - t0
                out = eng.generate(prompts, **sample)
                runs[name] = {"start_s": start_s, "tokens": [s.response for s in out],
                              "logprobs": [s.logprobs for s in out]}
                if base_from == "trainer":
                    t0 = time.perf_counter()
                    eng.restart()
                    runs["restart"] = {"start_s": time.perf_counter() - t0}
                    out = eng.generate(prompts, **sample)
                    runs["restart"].update(tokens=[s.response for s in out], logprobs=[s.logprobs for s in out])
                    syncs = list(eng.base_syncs)
                    runs["http"] = _http(eng, tensors, a.bucket_mb, prompts, sample)
            finally:
                eng.stop()
        peer = peer_join(model, d, prompts, sample, dtype=a.dtype, bucket_mb=a.bucket_mb)
    peer_sampled = (peer.pop("peer_tokens"), peer.pop("peer_logprobs"))
    t, r = syncs
    moved = t["move_s"]
    calc = published_check()
    result = {
        "model": model, "model_bytes": nbytes, "dtype": a.dtype, "bucket_mb": a.bucket_mb, "buckets": t["buckets"],
        "exact": runs["disk"]["tokens"] == runs["trainer"]["tokens"]
        and runs["disk"]["logprobs"] == runs["trainer"]["logprobs"],
        "restart_exact": runs["disk"]["tokens"] == runs["restart"]["tokens"]
        and runs["disk"]["logprobs"] == runs["restart"]["logprobs"],
        "disk_start_s": runs["disk"]["start_s"], "trainer_start_s": runs["trainer"]["start_s"],
        "sync_s": t["total_s"], "init_s": t["init_s"], "move_s": t["move_s"], "copy_s": t["copy_s"], "transport_s": t["transport_s"],
        "load_s": t["load_s"],
        "shm_gbps": t["bytes"] / moved / 1e9, "memcpy_gbps": nbytes / memcpy_s / 1e9,
        "shm_vs_memcpy": (t["bytes"] / moved) / (nbytes / memcpy_s),
        "restart_start_s": runs["restart"]["start_s"], "restart_sync_s": r["total_s"], "restart_move_s": r["move_s"],
        "restart_copy_s": r["copy_s"], "restart_load_s": r["load_s"],
        "restart_shm_gbps": r["bytes"] / r["move_s"] / 1e9,
        "restart_vs_memcpy": (r["bytes"] / r["move_s"]) / (nbytes / memcpy_s),
        "peer_exact": (runs["disk"]["tokens"], runs["disk"]["logprobs"]) == peer_sampled, **peer,
        "calc_error_max": calc["calc_error_max"], "kimi_k2_bf16_128_s": kimi_k2_bf16(128)["shard"]["seconds"],
        **{k: v for k, v in runs["http"].items() if k not in ("tokens", "logprobs")},
        "http_exact": (runs["disk"]["tokens"], runs["disk"]["logprobs"])
        == (runs["http"]["tokens"], runs["http"]["logprobs"]),
        "http_vs_shm": runs["http"]["http_gbps"] / (r["bytes"] / r["move_s"] / 1e9),
    }
    emit(result, a.json)
    return result
