"""bench sync's two-engine figures: two engines get the base from the trainer's store (rollout.base_from=peer),
engine A generates without a pause while engine B is SIGKILLed and restarted, taking the base from A (A's tokens per
second while it gives B the base, against its rate before); then the base broadcast to both at once over gloo as a
new version (transfer/gloo_sender.py).

    figures = peer_join(model, log_dir, prompts, sample, dtype=..., bucket_mb=..., before_s=6.0)
"""
from __future__ import annotations

import os
import signal
import threading
import time


def _rate(calls: list[tuple[float, float, int]], lo: float, hi: float) -> float:
    """Tokens per second over [lo, hi], each call's tokens spread evenly over its own span."""
    if hi <= lo:
        return float("nan")
    got = sum(n * max(0.0, min(t1, hi) - max(t0, lo)) / (t1 - t0) for t0, t1, n in calls if t1 > t0)
    return got / (hi - lo)


def peer_join(model: str, log_dir, prompts, sample: dict, *, dtype: str, bucket_mb: float,
              before_s: float = 6.0) -> dict:
    from ...rollout.placement import Placement
    from ...rollout.replicas import Replicas

    # the host's cores split between the two engines, as the main job splits them (rl/producer.py)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    reps = Replicas.start(model, [Placement(), Placement()], dtype=dtype, log_dir=log_dir, prefix_caching=False,
                          capture=False, base_from="peer", base_bucket_mb=bucket_mb, threads=threads)
    calls: list[tuple[float, float, int]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def generate_on_a():
        loop = dict(sample, max_tokens=8)
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                out = reps[0].generate(prompts, **loop)
            except BaseException as e:  # noqa: BLE001 - reported after the join
                errors.append(e)
                return
            calls.append((t0, time.perf_counter(), sum(len(s.response) for s in out)))

    a, b = reps[0], reps[1]
    try:
        worker = threading.Thread(target=generate_on_a, name="engine-a-load", daemon=True)
        worker.start()
        time.sleep(before_s)
        t_kill = time.perf_counter()
        os.kill(b.pid, signal.SIGKILL)
        b.proc.wait(30)
        reps.restart(1)
        t_up = time.perf_counter()
        sync = b.base_syncs[-1]
        time.sleep(1.0)
        stop.set()
        worker.join(120)
        if errors:
            raise errors[0]
        out = b.generate(prompts, **sample)
        gloo = _gloo(reps, model, bucket_mb)
        before = _rate(calls, t_kill - before_s + 1.0, t_kill)
        during = _rate(calls, t_up - sync["total_s"], t_up)
        return {"peer_join_s": t_up - t_kill, "peer_sync_s": sync["total_s"], "peer_move_s": sync["move_s"],
                "peer_copy_s": sync["copy_s"], "peer_load_s": sync["load_s"],
                "peer_shm_gbps": sync["bytes"] / sync["move_s"] / 1e9, "peer_port_ok": sync["peer_port"] == a.port,
                "peer_tokens_per_s_before": before, "peer_tokens_per_s_during": during,
                "peer_tokens_per_s_ratio": during / before,
                "peer_tokens_per_s_ratio_restart": _rate(calls, t_kill, t_up) / before,
                "peer_engine_threads": threads, "peer_tokens": [s.response for s in out], "peer_logprobs": [s.logprobs for s in out], **gloo}
    finally:
        stop.set()
        reps.stop()


def _gloo(reps, model: str, bucket_mb: float) -> dict:
    """The checkpoint to both engines at once over one gloo group, as base version 2 (the same bytes)."""
    from ...transfer.gloo_sender import GlooBroadcast
    from ...transfer.shm_sender import checkpoint_tensors
    from ...transfer.base_store import BaseStore

    store = BaseStore(checkpoint_tensors(model), int(bucket_mb * (1 << 20)), version=2)
    try:
        store_s = time.perf_counter()
        for i in range(len(store.buckets)):
            store.data(i)                           # written before the timing: the broadcast reads them
        store_s = time.perf_counter() - store_s
        with GlooBroadcast([e.transport.call for e in reps]) as cast:
            t = cast.send(store)
            served = [e.transport.call("moe_lora_base_status")["served"] for e in reps]
    finally:
        store.close()
    return {"gloo_engines": t["engines"], "gloo_init_s": cast.init_s, "gloo_sync_s": t["total_s"],
            "gloo_move_s": t["move_s"], "gloo_load_s": t["load_s"], "gloo_store_s": store_s,
            "gloo_broadcast_gbps": t["bytes"] / t["move_s"] / 1e9, "gloo_served": served}
