"""Importance-based KV eviction in the engine (vllm/kv_evict.py), against an fp32 reference (tests/kit/sparse_evict.py):
vLLM fp32 with an expert adapter served and routing capture on samples 116-token sequences under SnapKV-style
eviction (budget 48: 4 sinks, 28 chosen, the last 16; a compression every 8 steps scored by the last 8 queries);
HF transformers with the same adapter merged and, per layer and KV head, the tokens the engine held for each query
as an attention mask gives the same logprobs within 3e-5. Controls: the dense mask, and one kept token of one
compression swapped for an evicted one, differ by > 1e-2. The engine's choice is recomputed from HF's own queries and
keys and agrees on every kept position; scored by a window one query earlier (the control) it does not. Every route
is captured, and the allocator got back the blocks between the two regions.
"""
import pytest

from moe_lora_rl.checks.torchrun import run_process
from moe_lora_rl.checks.tolerances import SPARSE_EVICT_LOGPROBS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_evicting_sampler_matches_hf_with_the_held_tokens(tmp_path):
    from moe_lora_rl.data.warm_start import warm_started

    res = run_process("kit.sparse_evict", ["--model", str(warm_started("glm4_moe", "wide"))],
                      cwd=tmp_path)
    d = res["logprob_max_diff"]
    assert d["same"] <= SPARSE_EVICT_LOGPROBS, d
    assert min(d["dense"], d["swapped"]) > 1e-2, d
    assert res["selection_agree"] == 1.0 and res["selection_agree_lagged"] < 0.99, res
    assert min(res["seq_lens"]) >= 100 and min(res["events_per_seq"]) >= 5, res
    assert all(s == [n - 1, 3, 8] for s, n in zip(res["routes_shapes"], res["seq_lens"])), res
    st = res["stats"]
    # 116 tokens in 32-token blocks: the compacted region's block and the recent tokens' block stay, 2 go back
    assert st["restarts"] == 0 and st["blocks_freed"] == 2 * st["sequences"], st
