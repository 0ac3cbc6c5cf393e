"""Sparse rollouts end to end on CPU (Sparse-RL): the engine's windowed KV cache and the corrections in the loss.

- The sparse sampler is what we think it is (tests/kit/sparse_sampler.py): vLLM fp32 on a 32-token window, an expert
  adapter served and routing capture on, samples 100-token sequences whose logprobs equal HF transformers with the
  same adapter merged and the same windowed attention mask within 1e-4; controls: the dense mask and windows of 31
  and 33 tokens differ by > 1e-2. Every route is captured (prompt + response - 1 rows), also on a repeated prompt.
- The ratio is computed on the right tokens: the main job on the long task's prompts (the default model's
  checkpoint: no second warm start) with fp32 rollouts, R3 and an adapter served, compression switched on with a
  budget covering every sequence: the consistency ratio between the
  trainer's dense recompute and the sampler is 1 within 1e-5 and nothing is rejected. Control: the same step with
  an 8-token window (shorter than the prompt), or with importance eviction at a 20-token budget, moves the ratio
  far from 1 and masks tokens; the same eviction with the trainer replaying it (rollout.kv_replay: each query of the
  trainer's forward attends to the tokens the engine held for it) brings the ratio back to 1 within 3e-5 (measured
  5.5e-6) with nothing rejected.
- The engine's allocator holds fewer KV blocks per sequence on a window and the same pool serves more sequences at
  once (bench/workers/sparse_kv_worker.py).
"""
import pytest

from moe_lora_rl.checks.torchrun import run_process
from moe_lora_rl.checks.tolerances import SPARSE_EVICT_LOGPROBS
from moe_lora_rl.checks.train_runs import finish_train, start_train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _model():
    from moe_lora_rl.data.warm_start import warm_started

    return str(warm_started("glm4_moe", "wide"))


def test_sparse_sampler_matches_hf_with_the_same_window(tmp_path):
    res = run_process("kit.sparse_sampler", ["--model", _model(), "--window", "32"], cwd=tmp_path)
    d = res["logprob_max_diff"]
    assert res["layout"]["sliding_window"] == 32
    assert d["same"] <= 1e-4, d
    assert min(d["dense"], d["shorter"], d["longer"]) > 1e-2, d          # the reference can tell windows apart
    assert all(s == [n - 1, 3, 8] for s, n in zip(res["routes_shapes"], res["seq_lens"])), res
    assert min(res["seq_lens"]) > 3 * 32 and res["repeat_equal"]


LONG = ["data.task=sort_trace", "data.length=10", "data.n_eval=16", "data.eval_samples=1",
        "algo.max_response_tokens=88", "algo.prompts_per_step=2", "algo.group_size=4", "algo.micro_batch_size=4",
        "steps=1", "eval_every=0", "runtime.rollout_dtype=float32", "algo.rollout_is=sparse"]


def test_consistency_ratio_is_one_without_compression_and_moves_with_it(tmp_path):
    kv = {"covering": ["rollout.kv_compression=window", "rollout.kv_budget=256"],
          "window": ["rollout.kv_compression=window", "rollout.kv_budget=8"],
          # prompts of 20-25 digits (43+ tokens): the compacted block (32-token blocks) ends before the recent
          # tokens' block, so the prompt is compressed right after its prefill (this model answers in a few tokens)
          "snapkv": ["rollout.kv_compression=snapkv", "rollout.kv_budget=20", "rollout.kv_evict.recent=8",
                     "rollout.kv_evict.interval=4", "data.task=sort_long", "data.mix='20-25:1.0'",
                     "algo.max_response_tokens=400"]}
    kv["snapkv_replay"] = [*kv["snapkv"], "rollout.kv_replay=true"]
    own = ("data.task=", "data.length=", "algo.max_response_tokens=")
    procs = {name: start_train(tmp_path / name, [*(o for o in LONG if "snapkv" not in name or not o.startswith(own)),
                                                 f"model.path={_model()}", *over])
             for name, over in kv.items()}                               # side by side: start-up dominates them
    runs = {name: finish_train(p, tmp_path / name) for name, p in procs.items()}
    _, (full,), _ = runs["covering"]
    assert abs(full["sparse/ratio_min"] - 1) <= 1e-5 and abs(full["sparse/ratio_max"] - 1) <= 1e-5, full
    assert full["sparse/seq_rejected_frac"] == 0.0 and full["sparse/token_masked_frac"] == 0.0
    _, (replayed,), _ = runs["snapkv_replay"]
    assert max(abs(replayed["sparse/ratio_min"] - 1), abs(replayed["sparse/ratio_max"] - 1)) <= SPARSE_EVICT_LOGPROBS
    assert replayed["sparse/seq_rejected_frac"] == 0.0 and replayed["sparse/token_masked_frac"] == 0.0, replayed
    for name in ("window", "snapkv"):
        summary, (row,), _ = runs[name]
        assert row["sparse/token_masked_frac"] > 0 and row["sparse/log_ratio_abs_mean"] > 1e-2, (name, row)
        assert 0 <= summary["eval_end_dense"] <= 1


def test_windowed_engine_holds_fewer_blocks_and_serves_more_at_once(tmp_path):
    """The allocator's own counts, dense vs a 32-token window, the same 12 requests of 85 forced tokens on a pool of
    16 blocks: blocks held per sequence at the peak (4 vs 2 of 32 tokens) and the most sequences served at once
    without a preemption."""
    res = {m: run_process("moe_lora_rl.bench.workers.sparse_kv_worker",
                          ["--model", _model(), "--method", m, "--budget", b, "--pool-blocks", "16", "--requests", "12"],
                          cwd=tmp_path) for m, b in (("none", "0"), ("window", "32"))}
    dense, sparse = res["none"], res["window"]
    assert dense["kv"]["peak_blocks_per_seq"] == 4 and sparse["kv"]["peak_blocks_per_seq"] == 2, res
    assert sparse["concurrency"] >= 1.5 * dense["concurrency"] > 0, res
