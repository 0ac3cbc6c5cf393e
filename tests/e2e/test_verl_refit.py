"""Weight sync from our engine inside verl: get_per_tensor_param in checkpoint-engine mode (no arguments: the engine
tracks the base sync; header with version and checksum in the stream) and in the colocated mode (peft_config back),
through verl's colocated sender and through our checkpoint-engine backend into an in-process vLLM engine's worker
extension. vLLM's log-probs then equal
Megatron+LoRA's within 1e-3 (same fp32 math; ~1.5e-5 measured); the adapters move them by far more (control); a
corrupted stream is refused and the served version kept."""
import json
import subprocess
import sys

import pytest

from moe_lora_rl.checks.torchrun import worker_env

pytestmark = [pytest.mark.vllm, pytest.mark.verl]


@pytest.fixture(scope="module")
def res():
    from moe_lora_rl.models import get_model

    proc = subprocess.run([sys.executable, "-m", "moe_lora_rl.checks.verl_refit", "--model",
                           str(get_model("glm4_moe", "tiny"))], env=worker_env(), capture_output=True, text=True,
                          timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_adapter_only_after_first_base_sync(res):
    assert res["first_meta"]["base"] is True and res["second_meta"]["base"] is False
    assert res["first_names"] > res["first_lora_names"] == res["second_lora_names"] == res["second_names"] > 0
    assert res["first_meta"]["checksum"] == res["second_meta"]["checksum"] and res["second_meta"]["version"] == 1
    assert res["peft_config_checkpoint_mode"] is None                    # verl drops it there: not needed
    assert res["colocated_peft_r"] == 4 and res["colocated_names"] == res["second_names"]


def test_colocated_sync_base_then_adapters(res):
    """verl's colocated path (its BucketedWeightSender over shared memory -> update_weights_from_ipc) into an engine
    started on dummy weights: the base sync loads the real base, the adapters follow; the second call of the same
    version is a no-op."""
    assert res["dummy_vs_megatron_base"] > 1.0, res                  # control: dummy weights are far off
    assert res["colocated_base"]["base_tensors"] > 0 and res["colocated_base"]["version"] == 1, res
    assert res["colocated_lora"] == dict(res["colocated_base"], base_tensors=0, unchanged=True), res
    assert res["colocated_logprob_diff"] <= 1e-3 < res["base_vs_lora"], res


def test_colocated_corrupted_stream_refused_without_hanging(res):
    assert "checksum" in res["colocated_bad_refused"], res["colocated_bad_refused"]
    assert res["colocated_after_bad_diff"] == res["colocated_logprob_diff"], res


def test_vllm_logprobs_match_megatron_after_refit(res):
    """Checkpoint-engine mode: the next version (other adapters) through our backend."""
    assert res["refit_logprob_diff"] <= 1e-3 < res["v1_vs_v2"], res
    assert res["buckets"] > 1 and "'version': 2" in res["served"], res


def test_corrupted_stream_refused_and_version_kept(res):
    assert "checksum" in res["bad_refused"], res["bad_refused"]
    assert res["after_bad_diff"] == res["refit_logprob_diff"], res


def test_base_backend_fills_an_empty_engine(res):
    """"moe_lora_base": verl's first stream (header + base + adapters) into a second engine started on dummy weights
    (which serve far off: dummy_vs_megatron_base), through vLLM's weight-transfer calls; then the adapters-only
    stream of the next version."""
    out, out2 = res["base_backend_out"], res["base_backend_out2"]
    assert out["moe_lora/base_version"] == 1 and out["moe_lora/base_tensors"] == res["first_names"] - \
        res["first_lora_names"], out
    assert out["moe_lora/base_transports"] == ["http"], out          # base_transport=http: each bucket inline
    assert res["base_backend_diff"] <= 1e-3 < res["base_vs_lora"], res
    assert "moe_lora/base_version" not in out2 and out2["moe_lora/refit_version"] == 2, out2
    assert res["base_backend_diff2"] <= 1e-3 < res["v1_vs_v2"], res


def test_base_backend_mailbox_fills_an_empty_engine(res):
    """"moe_lora_base" through the mailbox (verl's async trainers): an engine started on dummy weights gets the base
    with version 1's adapters, then version 2's adapters alone, through verl's sender into update_weights_from_ipc
    (base_sync_done=False, as verl's CheckpointEngineWorker calls it); it then serves Megatron's log-probs."""
    names, (s1, s2) = res["mailbox_names"], res["mailbox_sync"]
    assert names == [res["first_names"], res["first_lora_names"]], names
    assert s1["base_tensors"] == res["first_names"] - res["first_lora_names"] and s1["version"] == 1, s1
    assert s2["base_tensors"] == 0 and s2["version"] == 2 and not s2["unchanged"], s2
    assert res["mailbox_diff"] <= 1e-3 < min(res["dummy_vs_megatron_base"], res["base_vs_lora"]), res
    assert res["mailbox_diff2"] <= 1e-3 < res["v1_vs_v2"], res


def test_a_colocated_base_that_fails_to_load_leaves_the_previous_weights(res):
    """A base stream with model.norm.weight one row too long into an engine started empty: refused, and the engine
    serves exactly its previous (dummy) weights; the right stream then loads (mailbox_diff above). Before the
    rollback, vLLM's finalize ran over the half-loaded model."""
    assert res["bad_base_norm"] and "129" in res["bad_base_refused"], res["bad_base_refused"]
    assert res["bad_base_diff"] == 0.0, res
    # a stream missing model.norm.weight: refused naming it, the engine exactly as before
    assert "model.norm.weight" in res["short_base_refused"] or "norm" in res["short_base_refused"], res
    assert res["short_base_diff"] == 0.0, res
