"""The GPU check: megatron-core on CUDA in bf16 with per-expert LoRA and R3 replay, and a CUDA IPC bucket handoff
between two processes, each against the CPU result; one JSON line. Run by scripts/gpu_check.sh (docs/setup.md,
"GPU check"):

    python -m kit.gpu_check [--parts replay,ipc,base_ipc] [--bucket-mib 2] [--probe]

replay  two processes (tests/kit/gpu_check_worker.py) run the same case at world size 1: CUDA in bf16 (NCCL) and the
        CPU in fp32 (gloo, CUDA hidden), concurrently. Compared over the tokens that carry routes: logits (the worst
        token's max |diff| / max |reference logit|, FIDELITY_TOL[bf16] as R3 in tests/distributed/test_bf16.py),
        label logprobs (per token |diff| / max |reference logit|, twice that: log p = z_y - logsumexp(z)), the
        adapter gradients of one step (max |diff| / max |reference|, TRAINED_BF16) and the step itself (AdamW's
        first step is lr * sign(g): where |g| exceeds the gradient tolerance no sign can flip, so the adapters
        must agree there to 1% of lr). Controls: the CUDA forward replaying the shuffled routes, and the step
        taken on them, must miss the same reference by more than 4x the tolerance (the step: a flipped sign).
ipc     a receiver process (spawned) holds FakeEngine's staged push and the worker extension's own
        moe_lora_bucket_ipc; this process pushes a mixed-dtype payload in several buckets through
        transfer.transports.CudaIpcTransport. The staged tensors must equal the CPU payload byte for byte, with the
        commit's digest equal to the CPU checksum. Control: a second push whose first bucket is changed by one bit
        after its CRC was taken must be refused by that CRC, and version 1 stays served.
base_ipc the full-weight sync's `ipc` transport (transfer/cuda_ipc.py): the same payload as a base store's
        buckets, each copied to this GPU and shared as a JSON CUDA IPC handle; a spawned receiver opens each one,
        copies it and checks the store's digest on a host copy, as the engine does (vllm/base_sync.py). Every bucket
        must pass with the store's bytes. Control: a bucket whose device copy has one bit flipped after its digest was
        taken must be refused by that digest.

Exit status: 0 every part passed, 1 a part failed, 2 no GPU here (one line on stdout, nothing run, no traceback).
Calibration on the CPU (bf16 vs fp32, both on the CPU; not a GPU result): logits 0.046 (11.7u) vs tolerance 0.0625,
shuffled 1.49; logprobs 0.019 vs 0.125, shuffled 0.73; gradients 0.030 vs 0.0625, shuffled 0.76; step 7e-9 where
confident vs 1e-5, shuffled 2e-3 (= 2 lr).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

EXIT_PASS, EXIT_FAIL, EXIT_NO_GPU = 0, 1, 2
PARTS = ("replay", "ipc", "base_ipc")
CONTROL_FACTOR = 4             # a control must miss the reference by more than 4x the tolerance (test_bf16.py)
STEP_FRACTION = 0.01           # where no gradient sign can flip, the adapters after the step agree to 1% of lr


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check", description="megatron-core R3 + LoRA on CUDA and a CUDA IPC "
                                 "bucket handoff, each against the CPU; one JSON line")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    ap.add_argument("--bucket-mib", type=int, default=2, help="IPC bucket size in MiB (the payload is 7.6 MiB)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for each process of the replay part")
    ap.add_argument("--probe", action="store_true", help="only say whether this machine can run the check: the "
                    "no-GPU line and exit 2, or nothing and exit 0")
    a = ap.parse_args(argv)
    parts = tuple(p for p in a.parts.split(",") if p)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"--parts {a.parts!r}: choose from {PARTS}")
    if a.bucket_mib <= 0:
        ap.error(f"--bucket-mib {a.bucket_mib}: must be > 0")
    a.parts = parts
    return a


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the check (torch missing, or no CUDA device), or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return None


# -- replay: the comparison (pure) ---------------------------------------------------------------------------------
def routed_positions(lengths: list[int], seq_len: int):
    """[N, S] bool: the positions that carry routes (sample i: its first lengths[i] - 1 tokens)."""
    import torch

    return torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None] - 1


def token_errors(got, ref, mask) -> tuple[float, float, float]:
    """(worst token's max_v |diff| / max_v |ref|, max |diff|, max |ref|) over the masked tokens of [N, S, V]."""
    diff, scale = (got - ref).abs().amax(-1)[mask], ref.abs().amax(-1)[mask]
    return float((diff / scale).max()), float(diff.max()), float(scale.max())


def rel_max(got: dict, ref: dict) -> float:
    if got.keys() != ref.keys():
        raise ValueError(f"adapter names differ: {sorted(set(got) ^ set(ref))[:4]}")
    return max(float((got[k] - ref[k]).abs().max()) for k in ref) / max(float(v.abs().max()) for v in ref.values())


def step_error(got: dict, ref: dict, grads_tol: float) -> float:
    """max |step_got - step_ref| over the adapter entries whose reference gradient exceeds grads_tol x its largest
    (their sign cannot flip when the gradients agree within grads_tol); the steps are taken from the same start."""
    g_ref = ref["update"]["grads"]
    thr = grads_tol * max(float(g.abs().max()) for g in g_ref.values())
    worst = 0.0
    for k, g in g_ref.items():
        sel = g.abs() > thr
        if sel.any():
            d = (got["update"]["adapters"][k] - got["before"][k]) - (ref["update"]["adapters"][k] - ref["before"][k])
            worst = max(worst, float(d.abs()[sel].max()))
    return worst


def compare_replay(got: dict, ref: dict, lengths: list[int]) -> dict:
    """The replay part's figures and verdict: `got` the CUDA bf16 case, `ref` the CPU fp32 case."""
    import torch

    from moe_lora_rl.checks.tolerances import FIDELITY_TOL, TRAINED_BF16

    if got["before"].keys() != ref["before"].keys() or not all(torch.equal(got["before"][k], ref["before"][k])
                                                               for k in ref["before"]):
        raise ValueError("the two cases started from different adapters")
    tol, lr = FIDELITY_TOL[torch.bfloat16], ref["lr"]
    mask = routed_positions(lengths, ref["logits"].shape[1])
    rel, diff, scale = token_errors(got["logits"], ref["logits"], mask)
    shuf_rel = token_errors(got["shuffled_logits"], ref["logits"], mask)[0]
    lp_tol, lp_mask, lp_scale = 2 * tol, mask[:, :-1], ref["logits"][:, :-1].abs().amax(-1)
    lp_diff = (got["logprobs"] - ref["logprobs"]).abs()
    lp, lp_abs = float((lp_diff / lp_scale)[lp_mask].max()), float(lp_diff[lp_mask].max())
    lp_shuf = float(((got["shuffled_logprobs"] - ref["logprobs"]).abs() / lp_scale)[lp_mask].max())
    grads = rel_max(got["update"]["grads"], ref["update"]["grads"])
    grads_shuf = rel_max(got["shuffled_update"]["grads"], ref["update"]["grads"])
    step = step_error(got, ref, TRAINED_BF16)
    step_shuf = step_error({**got, "update": got["shuffled_update"]}, ref, TRAINED_BF16)
    moved = max(float((got["update"]["adapters"][k] - got["before"][k]).abs().max()) for k in got["before"])
    checks = {
        "logits": rel <= tol, "logprobs": lp <= lp_tol, "grads": grads <= TRAINED_BF16,
        "step": step <= STEP_FRACTION * lr and moved >= 0.5 * lr and not got["update"]["skipped"],
        "control_logits": shuf_rel > CONTROL_FACTOR * tol, "control_logprobs": lp_shuf > CONTROL_FACTOR * lp_tol,
        "control_grads": grads_shuf > CONTROL_FACTOR * TRAINED_BF16, "control_step": step_shuf > lr,
    }
    return {"dtype": f"{got['dtype']} on {got['device']} vs {ref['dtype']} on {ref['device']}",
            "logits_max_rel": rel, "logits_max_abs": diff, "logits_tol_rel": tol, "shuffled_logits_max_rel": shuf_rel,
            "logprobs_max_rel": lp, "logprobs_max_abs": lp_abs, "logprobs_tol_rel": lp_tol,
            "shuffled_logprobs_max_rel": lp_shuf,
            "grads_max_rel": grads, "grads_tol_rel": TRAINED_BF16, "shuffled_grads_max_rel": grads_shuf,
            "step_max_diff": step, "step_tol": STEP_FRACTION * lr, "shuffled_step_max_diff": step_shuf,
            "step_moved": moved, "loss": [got["update"]["loss"], ref["update"]["loss"]],
            "token_disagreement_free_vs_forced": got["token_disagreement"],
            "failed": sorted(k for k, ok in checks.items() if not ok), "pass": all(checks.values())}


def run_replay(a: argparse.Namespace) -> dict:
    """The CUDA bf16 case and the CPU fp32 reference, concurrently, each in its own process; then compare."""
    import torch

    from moe_lora_rl.checks.torchrun import worker_env
    from .policy_update_worker import LENGTHS

    with tempfile.TemporaryDirectory() as d:
        cases = {"cuda": ("cuda", "bf16", {}), "cpu": ("cpu", "fp32", {"CUDA_VISIBLE_DEVICES": ""})}
        procs, t0 = {}, time.perf_counter()
        for key, (device, dtype, env) in cases.items():
            cmd = [sys.executable, "-m", "kit.gpu_check_worker", "--device", device, "--dtype", dtype,
                   "--out", os.path.join(d, f"{key}.pt")]
            log = open(os.path.join(d, f"{key}.log"), "w")
            procs[key] = (subprocess.Popen(cmd, env={**worker_env(), **env}, stdout=log, stderr=subprocess.STDOUT),
                          log)
        for key, (p, log) in procs.items():
            try:
                p.wait(timeout=max(1.0, a.timeout - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()
        failed = {k: p.returncode for k, (p, _) in procs.items() if p.returncode != 0}
        if failed:
            return {"pass": False, "error": "; ".join(f"{k} case exit {rc}: {_last_error(os.path.join(d, k + '.log'))}"
                                                      for k, rc in failed.items())}
        got, ref = (torch.load(os.path.join(d, f"{k}.pt"), weights_only=False) for k in ("cuda", "cpu"))
    return {**compare_replay(got, ref, list(LENGTHS)), "backend": got["backend"],
            "seconds": round(time.perf_counter() - t0, 1)}


def _last_error(path: str) -> str:
    """The last line of a failed process's log that names an error (else its last line), for the JSON line."""
    with open(path, errors="replace") as f:
        lines = [l.strip() for l in f if l.strip()]
    hits = [l for l in lines if any(w in l for w in ("Error", "error", "Exception")) and "Warning" not in l]
    return (hits or lines or ["(no output)"])[-1][-400:]


# -- ipc ---------------------------------------------------------------------------------------------------------
def ipc_payload(seed: int = 0) -> dict:
    """CPU tensors of mixed dtypes and sizes (7.6 MiB), deterministic from `seed`, named by layer like an adapter."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = [(1024, 1024), (4, 2048), (2048, 1024), (3, 5), (512, 1536), (1,)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float32, torch.bfloat16, torch.float32]
    out = {}
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        out[f"layers.{i // 2}.mlp.experts.{i}.lora_{'AB'[i % 2]}.weight"] = torch.randn(shape, generator=g).to(dt)
    out["layers.3.mlp.router.counts"] = torch.randint(0, 1 << 30, (4096,), generator=g, dtype=torch.int64)
    return out


def bytes_mismatch(sent: dict, got: dict) -> list[str]:
    """Names whose received tensor is missing, extra, or differs from the sent one in dtype, shape or any byte."""
    import torch

    bad = sorted(set(sent) ^ set(got))
    for k in sorted(set(sent) & set(got)):
        a, b = sent[k].contiguous(), got[k].contiguous()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(-1).view(torch.uint8),
                                                                       b.view(-1).view(torch.uint8)):
            bad.append(k)
    return bad


class PipeEngine:
    """The `llm` CudaIpcTransport talks to: collective_rpc over a Pipe to the receiver process (kit/
    gpu_check_worker.serve). perturb_next: the next bucket's first byte is flipped on the GPU after the transport
    took its CRC and made its handles (the control)."""

    def __init__(self, conn, timeout: float = 120.0):
        self.conn, self.timeout, self.transport, self.perturb_next = conn, timeout, None, False

    def call(self, method: str, *args):
        self.conn.send((method, args))
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"{method}: no answer from the receiver within {self.timeout:g} s")
        status, *rest = self.conn.recv()
        if status == "ok":
            return rest[0]
        kind, msg = rest
        if kind == "ValueError":                   # the engine refused: CudaIpcTransport lets a ValueError through
            raise ValueError(msg)
        raise RuntimeError(f"{kind}: {msg}")

    def collective_rpc(self, method: str, args=()):
        if method == "moe_lora_bucket_ipc" and self.perturb_next:
            import torch

            w = self.transport.alive[-1]          # the GPU copy whose IPC handle is in `args`
            w.view(-1).view(torch.uint8)[:1].bitwise_xor_(1)
            torch.cuda.synchronize()
            self.perturb_next = False
        return [self.call(method, *args)]

    def reset_prefix_cache(self) -> None:
        pass


@contextmanager
def _spawned(target):
    """A receiver process spawned on this GPU, target(its end of a pipe, the device): (this end, the device);
    joined at exit (killed after 30 s)."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    dev = torch.cuda.current_device()
    proc = ctx.Process(target=target, args=(theirs, dev), daemon=True)
    proc.start()
    try:
        yield mine, dev
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def run_ipc(a: argparse.Namespace) -> dict:
    from moe_lora_rl.transfer.push_plan import plan_buckets
    from moe_lora_rl.transfer.transports import CudaIpcTransport
    from moe_lora_rl.transfer.wire import checksum
    from .gpu_check_worker import serve

    with _spawned(serve) as (mine, _):
        engine = PipeEngine(mine)
        tr = CudaIpcTransport(engine)
        tr.bucket_bytes, engine.transport = a.bucket_mib << 20, tr
        sent = ipc_payload()
        want = checksum(sent)
        res = tr.push(1, sent, rank=4, alpha=8.0)
        got = engine.call("moe_lora_received")
        bad = bytes_mismatch(sent, got)
        engine.perturb_next = True
        try:
            tr.push(2, sent, rank=4, alpha=8.0)
            refused = "not refused"
        except ValueError as e:
            refused = str(e)
        status = engine.call("moe_lora_status")
        engine.call("stop")
    checks = {"bytes": not bad, "digest": res.served.get("checksum") == want,
              "control_refused": "checksum mismatch" in refused,
              "control_kept_v1": status.get("version") == 1 and status.get("staged") is None}
    plan = plan_buckets(1, {k: t.numel() * t.element_size() for k, t in sent.items()}, a.bucket_mib << 20)
    return {"tensors": len(sent), "bytes": res.bytes, "buckets": len(plan.buckets),
            "seconds": round(res.seconds, 3), "mismatched": bad, "digest": want, "served": res.served.get("checksum"),
            "control": refused[:200], "served_after_control": status.get("version"),
            "failed": sorted(k for k, ok in checks.items() if not ok), "pass": all(checks.values())}


def _open_base_buckets(conn, dev: int) -> None:
    """The receiver of base_ipc: each bucket's handle opened, copied and checked as the engine does; answers
    ("ok", the bytes' sha256) or ("error", the refusal)."""
    import hashlib

    import torch

    from moe_lora_rl.transfer.shm import check_digest, layout_entries
    from moe_lora_rl.transfer.cuda_ipc import open_shared

    torch.cuda.set_device(dev)
    while (info := conn.recv()) is not None:
        try:
            data = open_shared(info["handle"], f"cuda:{dev}").clone()
            host = data.cpu()
            check_digest(host, layout_entries(info["pieces"]), info["digest"], f"ipc bucket {info['index']}")
            conn.send(("ok", hashlib.sha256(host.numpy().tobytes()).hexdigest()))
        except Exception as e:  # noqa: BLE001 - the answer names the refusal
            conn.send(("error", f"{type(e).__name__}: {e}"[:300]))


def run_base_ipc(a: argparse.Namespace) -> dict:
    import hashlib

    import torch

    from moe_lora_rl.transfer.cuda_ipc import share
    from moe_lora_rl.transfer.base_store import BaseStore

    store = BaseStore(ipc_payload(), a.bucket_mib << 20, version=1)
    answers, t0 = [], time.perf_counter()
    try:
        with _spawned(_open_base_buckets) as (mine, dev):
            for i in range(len(store.buckets)):
                info, host = store.info(i), store.data(i)
                on_gpu = host.to(torch.device("cuda", dev))
                mine.send({**info, "handle": share(on_gpu), "transport": "ipc"})
                answers.append((mine.recv(), hashlib.sha256(host.numpy().tobytes()).hexdigest()))
            seconds = time.perf_counter() - t0
            info, flipped = store.info(0), store.data(0).to(torch.device("cuda", dev))
            flipped[0] ^= 1                                     # one bit, after the digest was taken
            mine.send({**info, "handle": share(flipped), "transport": "ipc"})
            control = mine.recv()
            mine.send(None)
    finally:
        store.close()
    bad = [i for i, ((kind, got), want) in enumerate(answers) if kind != "ok" or got != want]
    checks = {"buckets": not bad, "control_refused": control[0] == "error" and "checksum mismatch" in control[1]}
    return {"buckets": len(answers), "bytes": store.nbytes, "seconds": round(seconds, 3), "mismatched": bad,
            "control": control[1][:200], "failed": sorted(k for k, ok in checks.items() if not ok),
            "pass": all(checks.values())}


def main(argv=None) -> int:
    a = parse_args(argv)
    reason = no_gpu_reason()
    if reason is not None:
        print(f"gpu_check: no GPU: {reason}; nothing was run")
        return EXIT_NO_GPU
    if a.probe:
        return EXIT_PASS
    import torch

    out: dict = {"check": "gpu", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "cuda": torch.version.cuda}
    t0 = time.perf_counter()
    for part, fn in (("replay", run_replay), ("ipc", run_ipc), ("base_ipc", run_base_ipc)):
        if part in a.parts:
            try:
                out[part] = fn(a)
            except Exception as e:  # noqa: BLE001 - the JSON line names the failure; the other part still runs
                out[part] = {"pass": False, "error": f"{type(e).__name__}: {e}"[:400]}
    out["pass"] = all(out[p]["pass"] for p in a.parts)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out), flush=True)
    return EXIT_PASS if out["pass"] else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
