"""LoRA-only refit Megatron -> vLLM (CPU, fp32).

In-process engine (adapters handed over in memory): after pushing the adapters trained at Megatron layouts tp2ep2
and pp2ep2, vLLM's per-token logprobs of fixed sequences equal Megatron+LoRA's within 1e-3 (same fp32 math;
measured ~1e-5). The base model differs from the LoRA model by far more than that, so the check has teeth. Bad
pushes (an expert's adapter left out, a stale version, a wrong shape, an unknown name, a checksum mismatch) are
refused with ValueError and the engine keeps serving the previous complete version; the next good push recovers.

Separate server process: the same adapters pushed over /collective_rpc in buckets give the same logprobs through
/v1/completions, and so do they through a shared-memory segment; a second push while another version is staged is
refused naming both versions (the served version unchanged) until that version is aborted; a push to an engine that
is gone raises RefitError.
"""
import os

import pytest
import torch

from moe_lora_rl.checks.vllm_logprobs import megatron_logprobs
from kit.refit_vllm import run_vllm_worker
from moe_lora_rl.checks.tolerances import ADAPTER_MATTERS_MIN, REFIT_LOGPROBS
from moe_lora_rl.lora import LoRAConfig

pytestmark = pytest.mark.vllm

CFG = LoRAConfig(rank=4, alpha=8.0)
LAYOUTS = ["tp2ep2", "pp2ep2"]


@pytest.fixture(scope="module")
def trained(lora_trained):
    """The session's adapters trained at every default layout (tests/conftest.py); tp2ep2's and pp2ep2's are pushed."""
    models, _, work, cfg = lora_trained
    assert cfg == CFG, (cfg, CFG)
    return models, work


@pytest.fixture(scope="module")
def results(trained):
    models, work = trained
    return {m: run_vllm_worker(m, {l: work / f"{l}-m{i}.pt" for l in LAYOUTS}, work / "data.pt", CFG, work)
            for i, m in enumerate(models)}


def test_logprobs_match_after_refit(results):
    for m, r in results.items():
        for layout in LAYOUTS:
            rec = r["layouts"][layout]
            assert rec["logprob_max_diff"] <= REFIT_LOGPROBS, (m, layout, rec)
            assert rec["base_vs_lora"] > ADAPTER_MATTERS_MIN, (m, layout, rec)          # the adapter matters
        assert r["layouts"]["pp2ep2"]["served"]["version"] == 2


def test_bad_pushes_refused_and_previous_version_kept(results):
    for m, r in results.items():
        e = r["bad_push_errors"]
        assert "experts [3]" in e["missing_expert"], e
        assert "mlp.experts.3.down_proj: lora_B missing" in e["half_pair"], e
        assert "stale adapter version 2" in e["stale_version"], e
        assert "has shape" in e["wrong_shape"], e
        assert "no module 'mlp.foo'" in e["unknown_name"], e
        assert "checksum mismatch" in e["checksum"], e
        assert r["served_after_bad"]["version"] == 2
        assert r["unchanged_after_bad"] == 0.0
        assert r["recovered_version"] == 3
        # the full refit moves every weight: ~9x (glm4_moe tiny) to ~18x (qwen3_moe tiny) the rank-4 adapter bytes
        assert r["merged_logprob_max_diff"] <= REFIT_LOGPROBS and r["merged_bytes"] > 5 * r["layouts"]["tp2ep2"]["bytes"]


@pytest.mark.slow
def test_server_process_push_over_http(trained, tmp_path):
    from moe_lora_rl.refit.rename import to_peft_tensors
    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.rollout.openai_server import prompt_logprobs_http, start_server
    from moe_lora_rl.transfer import shm
    from moe_lora_rl.transfer.interface import RefitError
    from moe_lora_rl.transfer.transports import HttpTransport, ShmTransport
    from moe_lora_rl.transfer.wire import encode_blob
    from moe_lora_rl.procs import free_port

    models, work = trained
    i, model = next((i, m) for i, m in enumerate(models) if "glm4" in m)
    blob = torch.load(work / f"pp2ep2-m{i}.pt")
    data = torch.load(work / "data.pt")[model]
    peft = to_peft_tensors(blob["adapters"], load_arch(model))
    server = start_server(model, free_port(), log_dir=tmp_path)
    try:
        tr = HttpTransport(server.url)
        tr.bucket_bytes = 32 << 10                      # several buckets for the tiny adapter
        res = tr.push(1, peft, CFG.rank, CFG.alpha)
        assert res.served["version"] == 1 and tr.status()["version"] == 1
        got = torch.tensor(prompt_logprobs_http(server.url, data["eval"].tolist()), dtype=torch.float64)
        want = megatron_logprobs(data["eval"], blob["eval_logits"])
        assert (got - want).abs().max().item() <= REFIT_LOGPROBS
        with pytest.raises(ValueError, match="stale adapter version 1"):
            tr.push(1, peft, CFG.rank, CFG.alpha)
        assert tr.status()["version"] == 1
        # shared memory: one segment, one RPC; same logprobs; the pooled segment is the only one of ours, it is
        # renamed by every push (the previous handle is stale) and removed by close()
        others = {p.name for p in shm.ROOT.glob(f"{shm.PREFIX}{os.getpid()}-*")}       # other live clients' pools
        mine = lambda: sorted({p.name for p in shm.ROOT.glob(f"{shm.PREFIX}{os.getpid()}-*")} - others)  # noqa: E731
        st = ShmTransport(server.url)
        assert st.push(2, peft, CFG.rank, CFG.alpha).served["version"] == 2 and mine() == sorted(st.pool.handles())
        got2 = torch.tensor(prompt_logprobs_http(server.url, data["eval"].tolist()), dtype=torch.float64)
        assert (got2 - want).abs().max().item() <= REFIT_LOGPROBS
        # a second push while version 3 is in flight: refused naming both versions, version 2 keeps serving
        tr.call("moe_lora_begin", 3, None, CFG.rank, CFG.alpha, 1)
        with pytest.raises(ValueError, match="cannot begin version 4: version 3 is staged"):
            st.push(4, peft, CFG.rank, CFG.alpha)
        with pytest.raises(ValueError, match="bucket 0 of version 4: version 3 is staged"):
            tr.call("moe_lora_bucket_blob", 4, 0, encode_blob({}))
        assert tr.status()["version"] == 2 and mine() == sorted(st.pool.handles())
        tr.call("moe_lora_abort", 3)                   # the sender of version 3 gives up: the next push goes in
        old = st.pool.handles()
        assert st.push(4, peft, CFG.rank, CFG.alpha).served["version"] == 4
        with pytest.raises(ValueError, match="stale shared-memory handle"):
            tr.call("moe_lora_push_shm", 5, "seg-crc32:0:0", CFG.rank, CFG.alpha, old[0], [], os.getpid())
        assert tr.status()["version"] == 4
        st.close()
        assert not mine()
    finally:
        server.stop()
    with pytest.raises(RefitError, match="unreachable"):
        HttpTransport(server.url, timeout=5).push(2, peft, CFG.rank, CFG.alpha)
