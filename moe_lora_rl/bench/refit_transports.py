"""Cross-process push timings for `bench refit`: one adapter of the model (random, rank r, every routed expert's
projections, fp32) pushed to a vLLM server process on this host, side by side:

    memcpy_s      one in-memory copy of the payload's bytes (the floor any transport pays at least once)
    shm_push_s    ShmTransport.push: segments written, /collective_rpc with handles, read + CRC-checked + staged in
                  the server's worker, commit (adapter validated and served), segments removed
    http_push_s   HttpTransport.push: the same, with the bytes as base64 safetensors inside the JSON RPCs
commit_s: the server's part of the commit (validate, stack, swap), included in both push times. Medians of 3;
every push is a new version and ends with the commit and the prefix-cache reset."""
from __future__ import annotations

import statistics
import tempfile
import time


def transport_timings(model: str, rank: int, repeats: int = 3) -> dict:
    from ..megatron.hf_reference import load_arch
    from ..refit.server import start_server
    from ..refit.transports import HttpTransport, ShmTransport
    from ..testing.launch import free_port
    from .route_reference import random_expert_adapter

    arch = load_arch(model)
    peft = random_expert_adapter(arch, rank, seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in peft.values())
    memcpy = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copies = {k: v.clone() for k, v in peft.items()}
        memcpy.append(time.perf_counter() - t0)
        del copies
    with tempfile.TemporaryDirectory() as d:
        server = start_server(model, free_port(), log_dir=d)
        try:
            shm, http = ShmTransport(server.url), HttpTransport(server.url)
            version, times, commits = 0, {"shm": [], "http": []}, []
            for _ in range(repeats):
                for name, tr in (("shm", shm), ("http", http)):
                    version += 1
                    res = tr.push(version, peft, rank, 2.0 * rank)
                    times[name].append(res.seconds)
                    commits.append(res.served["commit_s"])
            served = shm.status()
        finally:
            server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"transport_adapter_bytes": nbytes, "memcpy_s": statistics.median(memcpy), "shm_push_s": med["shm"],
            "http_push_s": med["http"], "shm_speedup_vs_http": med["http"] / med["shm"],
            "commit_s": statistics.median(commits), "shm_served_version": served["version"], "transport_rank": rank}
