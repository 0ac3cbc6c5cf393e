"""rollout: the RL rollout engine process (rollout/client.py) as the driver uses it, per engine thread count.

    python -m moe_lora_rl.bench rollout --json [--model DIR] [--dtype float32] [--requests 64] [--group 8]
                                        [--prompt-len 23] [--max-tokens 8] [--threads 1,2] [--rank 8] [--repeats 3]

Per thread count (one engine process each, routing capture and prefix caching on): tps: generated tokens/s of one
generate call of `requests` requests (groups of `group` samples per prompt, temperature 1, median of `repeats`
calls after a first call, whose time is first_generate_s); push_s: a rank-`rank` expert adapter pushed through
engine.transport (ShmTransport, median of `repeats` pushes); idle_cpu_frac: the engine process's CPU time
(utime + stime) over 5 s of idling after that work, as a fraction of one core; startup_s: start() until the engine
answers (it includes the server's own warm-up generate).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from .emit import emit

IDLE_S = 5.0


def measure(model: str, arch, a, threads: int, log_dir: Path) -> dict:
    import torch

    from ..rollout.client import RolloutEngine
    from ..checks.route_reference import random_expert_adapter

    g = torch.Generator().manual_seed(0)
    prompts = [p for p in torch.randint(3, arch.vocab_size, (a.requests // a.group, a.prompt_len),
                                        generator=g).tolist() for _ in range(a.group)]
    t0 = time.perf_counter()
    eng = RolloutEngine.start(model, dtype=a.dtype, log_dir=log_dir, threads=threads)
    try:
        startup = time.perf_counter() - t0
        seeds = list(range(len(prompts)))
        t0 = time.perf_counter()
        eng.generate(prompts, seeds=seeds, max_tokens=a.max_tokens, temperature=1.0)      # warm-up
        first = time.perf_counter() - t0
        tps, times = [], []
        for r in range(a.repeats):
            t0 = time.perf_counter()
            out = eng.generate(prompts, seeds=[s + 1000 * (r + 1) for s in seeds], max_tokens=a.max_tokens,
                               temperature=1.0)
            dt = time.perf_counter() - t0
            times.append(dt)
            tps.append(sum(len(s.response) for s in out) / dt)
        pushes = []
        for v in range(1, a.repeats + 1):
            peft = random_expert_adapter(arch, a.rank, seed=v)
            pushes.append(eng.transport.push(v, peft, a.rank, 2.0 * a.rank).seconds)
        busy = eng.busy_s
        time.sleep(0.5)
        c0 = eng.cpu_seconds()
        time.sleep(IDLE_S)
        idle = (eng.cpu_seconds() - c0) / IDLE_S
        return {"tps": statistics.median(tps), "generate_s": statistics.median(times),
                "push_s": statistics.median(pushes), "idle_cpu_frac": idle, "startup_s": startup,
                "first_generate_s": first,
                "busy_s": busy, "adapter_bytes": sum(t.numel() * t.element_size() for t in peft.values())}
    finally:
        eng.stop()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench rollout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the small glm4_moe)")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=23)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", default="1,2", help="comma-separated engine thread counts, one engine each")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if a.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype {a.dtype!r}: choose one of float32, bfloat16")
    for name in ("requests", "group", "prompt_len", "max_tokens", "rank", "repeats"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.requests % a.group:
        raise ValueError(f"--requests {a.requests} is not a multiple of --group {a.group}")
    try:
        threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        raise ValueError(f"--threads {a.threads!r}: expected comma-separated integers") from None
    if any(t < 1 for t in threads):
        raise ValueError(f"--threads {a.threads!r}: thread counts must be >= 1")
    if a.model is None:
        from ..models import get_model

        a.model = str(get_model("glm4_moe", "small"))
    if not (Path(a.model) / "config.json").exists():
        raise ValueError(f"--model {a.model}: not an HF checkpoint directory (no config.json)")
    import transformers

    from ..models.arch import arch_from_hf_config

    arch = arch_from_hf_config(transformers.AutoConfig.from_pretrained(a.model))
    with tempfile.TemporaryDirectory() as d:
        per = {str(t): measure(a.model, arch, a, t, Path(d)) for t in threads}
    result = {"model": a.model, "dtype": a.dtype, "requests": a.requests, "group": a.group,
              "prompt_len": a.prompt_len, "max_tokens": a.max_tokens, "rank": a.rank, "threads": per}
    emit(result, a.json)
    return result
