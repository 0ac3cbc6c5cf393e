"""bench serve's prefix-cache figures (bench/workers/serve_worker.prefix_cache_fields): measured when the engine runs with
prefix caching; when vLLM turned it off (its CPU engine does for MLA, whatever is asked) they are None and named in
`skipped` with the reason, never reported as zero hits."""
from moe_lora_rl.bench.workers.serve_worker import prefix_cache_fields

MLA = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}
GQA = {"architectures": ["Qwen3MoeForCausalLM"]}


def test_prefix_figures_measured_or_skipped_with_the_reason():
    assert prefix_cache_fields(True, 96.0, 3, GQA) == ({"prefix_cache_hits": 96, "prefix_route_fills": 3}, {})
    assert prefix_cache_fields(True, 0.0, 0, MLA) == ({"prefix_cache_hits": 0, "prefix_route_fills": 0}, {})
    fields, skipped = prefix_cache_fields(False, 0.0, 0, MLA)
    assert fields == {"prefix_cache_hits": None, "prefix_route_fills": None}
    assert list(skipped) == ["prefix_cache_hits, prefix_route_fills"]
    assert "forces prefix caching (and chunked prefill) off for MLA" in skipped["prefix_cache_hits, prefix_route_fills"]
    fields, skipped = prefix_cache_fields(False, None, 0, GQA)
    assert fields["prefix_cache_hits"] is None and "MLA" not in next(iter(skipped.values()))
