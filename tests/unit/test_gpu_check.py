"""The GPU check (scripts/gpu_check.sh, tests/kit/gpu_check.py) on a machine without a GPU: it refuses in one
line with exit status 2 and runs nothing; its argument parsing and its pure comparison helpers, on CPU tensors.
The GPU parts themselves run only where a GPU is lent (docs/setup.md, "GPU check"); nothing here fakes their result."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kit import gpu_check as gc

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run scripts/gpu_check.sh")


def _script(python: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": python, "PIP_FIND_LINKS": "/nonexistent"})


def test_script_refuses_without_cuda_in_one_line():
    # PIP_FIND_LINKS is set: the refusal comes before any install
    p = _script(sys.executable)
    assert p.returncode == gc.EXIT_NO_GPU, (p.returncode, p.stdout, p.stderr)
    assert p.stdout.splitlines() == [p.stdout.strip()] and p.stdout.startswith("gpu_check: no GPU: "), p.stdout
    assert "torch.cuda.is_available() is False" in p.stdout and "nothing was run" in p.stdout
    assert "Traceback" not in p.stdout + p.stderr


def test_script_refuses_without_torch_in_one_line(tmp_path):
    bare = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=60)
    p = _script(str(bare / "bin" / "python"))
    assert p.returncode == gc.EXIT_NO_GPU, (p.returncode, p.stdout, p.stderr)
    assert p.stdout == "gpu_check: no GPU: torch is not installed; nothing was run\n"
    assert "Traceback" not in p.stderr


def test_args():
    a = gc.parse_args([])
    assert a.parts == gc.PARTS and a.bucket_mib == 2 and not a.probe
    assert gc.parse_args(["--parts", "ipc"]).parts == ("ipc",)
    for bad in (["--parts", "replay,foo"], ["--parts", ""], ["--bucket-mib", "0"], ["--backend", "nccl"]):
        with pytest.raises(SystemExit):
            gc.parse_args(bad)


def test_main_refuses_here(capsys):
    assert gc.main([]) == gc.EXIT_NO_GPU
    assert capsys.readouterr().out.count("\n") == 1


def _case(seed: int, noise: float = 0.0, shuffled: float = 1.0) -> dict:
    """A fake pair of check cases with known differences (2 rows, 4 positions, vocab 6; 2 adapter factors)."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.Generator().manual_seed(0)
    logits = 5 * torch.randn(2, 4, 6, generator=ref)
    grads = {"a": torch.randn(3, 4, generator=ref), "b": torch.randn(4, 3, generator=ref)}
    before = {k: torch.randn(v.shape, generator=ref) for k, v in grads.items()}
    lp = torch.log_softmax(logits, -1)[:, :-1, 0]

    def update(scale):
        gr = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in grads.items()}
        return {"grads": gr, "adapters": {k: before[k] - 1e-3 * gr[k].sign() for k in gr}, "loss": 1.0,
                "grad_norm": 1.0, "skipped": False}

    return {"device": "x", "dtype": "y", "lr": 1e-3, "token_disagreement": 0.5, "before": before,
            "logits": logits + noise * torch.randn(logits.shape, generator=g),
            "logprobs": lp + noise * torch.randn(lp.shape, generator=g),
            "shuffled_logits": logits + shuffled * 5 * torch.randn(logits.shape, generator=g),
            "shuffled_logprobs": lp + shuffled * 5 * torch.randn(lp.shape, generator=g),
            "update": update(noise / 5), "shuffled_update": update(shuffled)}


def test_compare_replay_passes_close_cases_and_needs_its_controls():
    ref = _case(1)
    ok = gc.compare_replay(_case(2, noise=1e-3), ref, [4, 3])
    assert ok["pass"] and ok["failed"] == [] and 0 < ok["logits_max_rel"] < ok["logits_tol_rel"], ok
    far = gc.compare_replay(_case(3, noise=2.0), ref, [4, 3])
    assert not far["pass"] and {"logits", "logprobs", "grads"} <= set(far["failed"]), far
    blind = gc.compare_replay(_case(4, noise=1e-3, shuffled=0.0), ref, [4, 3])      # routes that change nothing
    assert set(blind["failed"]) == {"control_logits", "control_logprobs", "control_grads", "control_step"}, blind
    with pytest.raises(ValueError, match="different adapters"):
        other = _case(5)
        other["before"] = {k: v + 1 for k, v in other["before"].items()}
        gc.compare_replay(other, ref, [4, 3])


def test_routed_positions_exclude_the_last_token_and_padding():
    m = gc.routed_positions([4, 2], 4)
    assert m.tolist() == [[True, True, True, False], [True, False, False, False]]


def test_payload_and_byte_comparison():
    sent = gc.ipc_payload()
    assert sent.keys() == gc.ipc_payload().keys() and all(torch.equal(v, gc.ipc_payload()[k]) for k, v in sent.items())
    assert len({v.dtype for v in sent.values()}) >= 4
    assert gc.bytes_mismatch(sent, {k: v.clone() for k, v in sent.items()}) == []
    k = next(iter(sent))
    flipped = {n: v.clone() for n, v in sent.items()}
    flipped[k].view(-1).view(torch.uint8)[:1].bitwise_xor_(1)
    assert gc.bytes_mismatch(sent, flipped) == [k]
    assert gc.bytes_mismatch(sent, {**sent, k: sent[k].float()}) == [k]                      # dtype
    assert gc.bytes_mismatch(sent, {n: v for n, v in sent.items() if n != k}) == [k]         # missing


def test_pipe_engine_and_receiver_process_without_cuda():
    """The two-process plumbing of the IPC part on CPU: a spawned receiver (serve without CUDA) staging plain buckets
    of InprocTransport over the Pipe; its refusal comes back as the engine's ValueError; the served version stays."""
    import torch.multiprocessing as mp

    from kit.gpu_check_worker import serve
    from moe_lora_rl.transfer.transports import InprocTransport
    from moe_lora_rl.transfer.wire import checksum

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(theirs, None), daemon=True)
    proc.start()
    try:
        engine = gc.PipeEngine(mine, timeout=60)
        tr = InprocTransport(engine)
        tr.bucket_bytes = 2 << 20
        sent = gc.ipc_payload()
        res = tr.push(1, sent, rank=4, alpha=8.0)
        assert res.served["version"] == 1 and res.served["checksum"] == checksum(sent)
        assert gc.bytes_mismatch(sent, engine.call("moe_lora_received")) == []
        with pytest.raises(ValueError):
            tr.push(1, sent, rank=4, alpha=8.0)                   # not newer than the served version
        status = engine.call("moe_lora_status")
        assert status["version"] == 1 and status["staged"] is None
        with pytest.raises(RuntimeError, match="AssertionError"):
            engine.call("moe_lora_nonexistent")
        engine.call("stop")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
