"""bench sync's peer join: two engines get the base from the trainer's store (rollout.base_from=peer), engine A
generates without a pause while engine B is SIGKILLed and restarted, taking the base from A; A's tokens per second
while it gives B the base, against its rate before.

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
    from ..rollout.placement import Placement
    from ..rollout.replicas import Replicas

    reps = Replicas.start(model, [Placement(), Placement()], dtype=dtype, log_dir=log_dir, prefix_caching=False,
                          capture=False, base_from="peer", base_bucket_mb=bucket_mb)
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
        before = _rate(calls, t_kill - before_s + 1.0, t_kill)
        during = _rate(calls, t_up - sync["total_s"], t_up)
        return {"peer_join_s": t_up - t_kill, "peer_sync_s": sync["total_s"], "peer_move_s": sync["move_s"],
                "peer_copy_s": sync["copy_s"], "peer_load_s": sync["load_s"],
                "peer_shm_gbps": sync["bytes"] / sync["move_s"] / 1e9, "peer_port_ok": sync["peer_port"] == a.port,
                "peer_tokens_per_s_before": before, "peer_tokens_per_s_during": during,
                "peer_tokens_per_s_ratio": during / before,
                "peer_tokens_per_s_ratio_restart": _rate(calls, t_kill, t_up) / before,
                "peer_tokens": [s.response for s in out], "peer_logprobs": [s.logprobs for s in out]}
    finally:
        stop.set()
        reps.stop()
