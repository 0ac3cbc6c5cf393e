"""One engine (dense or compressed KV) on a fixed KV pool, for bench sparse: the same requests (the long task's
held-out prompts, every response forced to the same length), stepped to the end, with the allocator's blocks and the
scheduler's running sequences read after every step (rollout/kv_meter.py).

    python -m moe_lora_rl.bench.workers.sparse_kv_worker --model DIR --method none|window|snapkv --budget N --pool-blocks B
        [--evict JSON] [--length 10] [--max-tokens 85] [--requests 128] [--at-cap N]  ->  "RESULT {...}"

concurrency: the most sequences the pool serves at once without a preemption (vLLM pushing a request back to waiting
for lack of blocks), found by bisection over the scheduler's running cap, every request run at each cap;
at_concurrency: that run's mean running sequences and throughput; uncapped: the pool left to vLLM's admission
(preempting); kv: the meter's snapshot (block bytes, blocks per running sequence time-averaged and at the peak).
Each run also reports its own blocks per running sequence, time-averaged over its steps and at its peak;
--at-cap N adds a run at N sequences at once (another engine's concurrency: the same concurrency for both).
"""
from __future__ import annotations

import argparse
import json
import time

from ...rollout.vllm_engine import make_engine, set_engine_env


def engine_parser() -> argparse.ArgumentParser:
    """The arguments of one engine with one KV compression (this worker's and tests/kit/sparse_probe.py's)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--evict", type=json.loads, default={}, help="snapkv's settings (rollout/kv_compression.py)")
    return ap


def main(argv=None) -> dict:
    set_engine_env()
    ap = engine_parser()
    ap.add_argument("--pool-blocks", type=int, required=True)
    ap.add_argument("--length", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=85)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--at-cap", type=int, default=0, help="also run every request at this many at once")
    a = ap.parse_args(argv)
    import transformers
    from vllm import SamplingParams

    from ...data.hf_sampling import prompt_ids
    from ...data.task import TaskSpec, make_split
    from ...rollout.kv_compression import engine_kwargs, install_method, verify
    from ...rollout.kv_meter import KVMeter

    cfg = json.loads(open(f"{a.model}/config.json").read())
    max_len = max(256, -(-(a.max_tokens + 64) // 32) * 32)          # the prompt (<= 64 tokens) and the answer
    llm = make_engine(a.model, prefix_caching=False, block_size=32, max_model_len=max_len, max_num_seqs=256,
                      num_gpu_blocks_override=a.pool_blocks, **engine_kwargs(a.method, a.budget, cfg))
    layout = verify(llm, a.method, a.budget)
    evictor = install_method(llm, a.method, a.budget, a.evict)
    meter = KVMeter(llm)
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    problems = make_split(TaskSpec(length=a.length, kind="sort_trace"), "eval")
    problems = [problems[i % len(problems)] for i in range(a.requests)]
    prompts = prompt_ids(tok, problems)
    eng, sched = llm.llm_engine, meter.sched
    batch = 0

    def run(cap: int) -> dict:
        """Every request once with at most `cap` running at a time: preemptions, mean running, throughput."""
        nonlocal batch
        batch += 1
        sched.max_num_active_reqs = cap               # admission into running (max_num_running_reqs: slots)
        for i, p in enumerate(prompts):
            eng.add_request(f"{batch}-{i}", {"prompt_token_ids": p},
                            SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=i, ignore_eos=True,
                                           detokenize=False))
        running, seen, tokens = [], {}, 0
        before, peak = meter.snapshot(), 0.0
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            outs = eng.step()
            meter.sample()
            seen.update((r.request_id, r) for r in sched.running)
            if sched.running:
                used = meter.pool.num_gpu_blocks - 1 - meter.pool.get_num_free_blocks()
                peak = max(peak, used / len(sched.running))
            done = sum(o.finished for o in outs)
            running.append(len(sched.running) + done)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)     # cumulative outputs
        wall = time.perf_counter() - t0
        preempted = sum(r.num_preemptions for r in seen.values())      # vLLM's own count per request
        after = meter.snapshot()
        return {"cap": cap, "preemptions": preempted, "running_mean": sum(running) / len(running),
                "tokens_per_s": tokens / wall, "wall_s": wall,
                "blocks_per_seq_mean": (after["block_steps"] - before["block_steps"])
                / max(1, after["seq_steps"] - before["seq_steps"]), "blocks_per_seq_peak": peak}

    free = run(256)                                   # max_num_seqs: as many as the pool admits (vLLM preempts)
    lo, hi, best = 1, a.pool_blocks, None             # the most sequences served at once without a preemption
    while lo <= hi:
        mid = (lo + hi) // 2
        r = run(mid)
        if r["preemptions"] == 0:
            lo, best = mid + 1, r
        else:
            hi = mid - 1
    at_cap = run(a.at_cap) if a.at_cap else None
    res = {"method": a.method, "budget": a.budget, "pool_blocks": a.pool_blocks, "layout": layout, "at_cap": at_cap,
           "concurrency": best["cap"] if best else 0, "at_concurrency": best, "uncapped": free,
           "kv": meter.snapshot(), "evictions": evictor.stats() if evictor else None}
    print("RESULT " + json.dumps(res))
    return res


if __name__ == "__main__":
    main()
