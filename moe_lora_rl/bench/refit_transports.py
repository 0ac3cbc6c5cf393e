"""Cross-process push timings for `bench refit`: one adapter of the model (random, rank r, every routed expert's
projections, fp32) pushed to a vLLM server process on this host, side by side:

    shm_push_s    ShmTransport.push: one segment written (CRCs computed while writing), one /collective_rpc with
                  the handle: read + digest-checked + staged in the server's worker, commit (adapter validated
                  and served); segment removed; prefix-cache reset
    http_push_s   HttpTransport.push: the same, with the bytes as base64 safetensors inside the JSON RPCs
    memcpy_s      one in-memory copy of the payload's bytes (the floor any transport pays at least once)
commit_s: the server's part of the commit (validate, stack, swap), included in both push times. The shm push is
split into shm_write_s (segment written + CRCs, sender), shm_rpc_s (the one moe_lora_push_shm RPC: of it
shm_read_s is the server's segment read + digest check, then the commit) and shm_reset_s (prefix-cache reset RPC).
Medians of 3; every push is a new version and ends with the commit and the prefix-cache reset."""
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
            version, times, commits, parts = 0, {"shm": [], "http": []}, [], []
            for _ in range(repeats):
                for name, tr in (("shm", shm), ("http", http)):
                    version += 1
                    res = tr.push(version, peft, rank, 2.0 * rank)
                    times[name].append(res.seconds)
                    commits.append(res.served["commit_s"])
                    if name == "shm":
                        parts.append({**tr.last_timing, "read_s": res.served["shm_read_s"]})
            served = shm.status()
        finally:
            server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"transport_adapter_bytes": nbytes, "memcpy_s": statistics.median(memcpy), "shm_push_s": med["shm"],
            "http_push_s": med["http"], "shm_speedup_vs_http": med["http"] / med["shm"],
            "commit_s": statistics.median(commits),
            **{f"shm_{k}": statistics.median(p[k] for p in parts) for k in ("write_s", "rpc_s", "read_s", "reset_s")},
            "shm_served_version": served["version"], "transport_rank": rank}
