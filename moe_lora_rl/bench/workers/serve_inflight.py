"""The engine loop's figures for bench serve, in the serve worker's process on one vLLM engine (rollout/loop.py):

    loop_vs_batch_call   the same requests through LLM.generate (the old batch call) and through the loop's
                         generate, alternated: tokens/s of each and the loop's overhead 1 - loop / batch
    inflight pushes      the loop kept full of requests for `window_s` without pushes, then for `window_s` with a
                         new adapter version pushed every `push_every_s` (moe_lora_push_shm: the segment written by
                         this process, read, checked and committed by the engine between two steps, as the server
                         does): generated tokens/s of each window, and inflight_push_stall_s, the mean time running
                         requests waited for one commit between two steps
"""
from __future__ import annotations

import os
import threading
import time


def _params(gen_len: int, seed: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=1.0, seed=seed, ignore_eos=True,
                          logprobs=0)


def loop_vs_batch_call(llm, loop, prompts, gen_len: int, repeats: int) -> dict:
    from ...rollout.tickets import Request

    sp = _params(gen_len, 0)
    batch_s = loop_s = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        loop.call(lambda l: l.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))
        batch_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        loop.generate([Request(p, sp) for p in prompts])
        loop_s += time.perf_counter() - t0
    n = repeats * len(prompts) * gen_len
    return {"tps_batch_call": n / batch_s, "tps_loop": n / loop_s, "loop_step_overhead": 1 - batch_s / loop_s}


class _Feeder(threading.Thread):
    """Keeps `depth` submissions of the prompts in the loop until stopped."""

    def __init__(self, loop, prompts, gen_len: int, depth: int = 2):
        super().__init__(daemon=True)
        self.loop, self.prompts, self.gen_len, self.depth = loop, prompts, gen_len, depth
        self.halt = threading.Event()

    def run(self):
        from ...rollout.tickets import Request

        seed = 0
        tickets = []
        while not self.halt.is_set():
            while len(tickets) < self.depth:
                seed += 1
                tickets.append(self.loop.submit([Request(p, _params(self.gen_len, seed * 1000 + i))
                                                 for i, p in enumerate(self.prompts)]))
            tickets.pop(0).results()
        for t in tickets:
            t.results()


def _window(loop, seconds: float, during=None) -> tuple[float, dict]:
    s0, t0 = dict(loop.stats), time.perf_counter()
    extra = during(seconds) if during else time.sleep(seconds)
    dt = time.perf_counter() - t0
    return (loop.stats["tokens"] - s0["tokens"]) / dt, {k: loop.stats[k] - s0[k] for k in ("stall_s", "commits")} \
        | (extra or {})


def inflight_pushes(loop, adapter: dict, rank: int, alpha: float, prompts, gen_len: int, window_s: float,
                    push_every_s: float, first_version: int) -> dict:
    from ...transfer import shm

    pool = shm.SegmentPool()
    version = [first_version]

    def push_loop(seconds: float) -> dict:
        t_end, n, rpc_s = time.perf_counter() + seconds, 0, 0.0
        while True:
            nxt = time.perf_counter() + push_every_s
            if nxt > t_end:
                break
            version[0] += 1
            handle, digest = pool.write(adapter, version[0], 0)
            t0 = time.perf_counter()
            loop.rpc("moe_lora_push_shm", (version[0], digest, rank, alpha, handle, shm.entries_of(adapter),
                                           os.getpid()))
            rpc_s += time.perf_counter() - t0
            n += 1
            time.sleep(max(0.0, nxt - time.perf_counter()))
        time.sleep(max(0.0, t_end - time.perf_counter()))
        return {"pushes": n, "push_rpc_s": rpc_s}

    feeder = _Feeder(loop, prompts, gen_len)
    feeder.start()
    try:
        time.sleep(min(2.0, window_s / 4))                                  # the loop full before measuring
        tps_quiet, _ = _window(loop, window_s)
        tps_push, w = _window(loop, window_s, push_loop)
    finally:
        feeder.halt.set()
        feeder.join()
        pool.close()
    n = max(w["pushes"], 1)
    return {"tokens_per_s_no_pushes": tps_quiet, "tokens_per_s_during_pushes": tps_push,
            "push_cost": 1 - tps_push / tps_quiet, "pushes": w["pushes"], "push_every_s": push_every_s,
            "inflight_push_stall_s": w["stall_s"] / n, "push_rpc_s": w["push_rpc_s"] / n,
            "served_version_after": version[0]}
