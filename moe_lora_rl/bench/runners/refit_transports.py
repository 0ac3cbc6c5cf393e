"""Cross-process push timings for `bench refit`: one adapter of the model (random, rank r, every routed expert's
projections, fp32) pushed to a vLLM server process on this host, side by side:

    shm_push_s    ShmTransport.push, from the call to its return: the adapter copied into the sender's pooled
                  segment and the segment digest computed over the bytes written (xxh3-64 if xxhash is installed,
                  else CRC-32: "shm_digest"), one /collective_rpc with handle, entries and digest (server: segment
                  copied into a reused receive buffer and its digest checked, staged, validated, committed: expert
                  factors stacked and served), then the prefix-cache reset RPC.
                  The segment is reused across pushes (its tmpfs pages exist), as are the server's receive
                  buffers: shm_first_push_s is the first push of a new transport (after one HTTP warm-up push that
                  builds the worker's adapter runtime), which also creates the segment and a receive buffer
    http_push_s   HttpTransport.push: the same, with the bytes as base64 safetensors inside the JSON RPCs
    memcpy_s      one in-memory copy of the payload's bytes (the floor any transport pays at least once)
commit_s: the server's activation (expert factors stacked, swap), validate_s: the server's adapter validation
(names, shapes, experts; the digest is checked before), both included in both push times. The shm push is split
into shm_write_s (segment filled + digest, sender), shm_rpc_s (the one moe_lora_push_shm RPC, HTTP -> API server ->
engine core -> worker and back: of it shm_read_s is the server's segment copy + digest check, then validate_s and
commit_s) and shm_reset_s (the prefix-cache reset RPC). Medians of `repeats` pushes each, shm and HTTP
alternating on one server; every push is a new version and ends with the commit and the prefix-cache reset."""
from __future__ import annotations

import statistics
import tempfile
import time


def transport_timings(model: str, rank: int, repeats: int = 5) -> dict:
    from ...models.arch import load_arch
    from ...rollout.openai_server import start_server
    from ...transfer.transports import HttpTransport, ShmTransport
    from ...procs import free_port
    from ...checks.route_reference import random_expert_adapter

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
        shm = None
        try:
            shm, http = ShmTransport(server.url), HttpTransport(server.url)
            version, times, served_t, parts = 0, {"shm": [], "http": []}, [], []
            http.push(version := version + 1, peft, rank, 2.0 * rank)      # warm-up: the worker's runtime
            first = shm.push(version := version + 1, peft, rank, 2.0 * rank).seconds   # creates the segment
            for _ in range(repeats):
                for name, tr in (("shm", shm), ("http", http)):
                    version += 1
                    res = tr.push(version, peft, rank, 2.0 * rank)
                    times[name].append(res.seconds)
                    served_t.append(res.served)
                    if name == "shm":
                        parts.append({**tr.last_timing, "read_s": res.served["shm_read_s"]})
                        digest_algo = res.served["checksum"].split(":")[0]      # seg-<algo>
            served = shm.status()
        finally:
            if shm is not None:
                shm.close()
            server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"transport_adapter_bytes": nbytes, "memcpy_s": statistics.median(memcpy), "shm_push_s": med["shm"],
            "http_push_s": med["http"], "shm_speedup_vs_http": med["http"] / med["shm"], "shm_first_push_s": first,
            "commit_s": statistics.median(s["commit_s"] for s in served_t),
            "validate_s": statistics.median(s["validate_s"] for s in served_t),
            **{f"shm_{k}": statistics.median(p[k] for p in parts) for k in ("write_s", "rpc_s", "read_s", "reset_s")},
            "shm_served_version": served["version"], "shm_digest": digest_algo, "transport_rank": rank,
            "repeats": repeats}
