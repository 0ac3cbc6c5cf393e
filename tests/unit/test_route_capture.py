"""Routing capture bookkeeping without an engine: a step where a MoE layer did not report, or a request whose rows
do not continue where they stopped, makes pop fail naming the request, the layers and the rows; the prefix store
fills the rows of prompt blocks served from the prefix cache."""
import numpy as np
import pytest
import torch

from moe_lora_rl.vllm.capture import RouteCapture
from moe_lora_rl.vllm.prefix_routes import PrefixRoutes


class _Req:
    def __init__(self, prompt):
        self.prompt_token_ids = prompt


class _Runner:
    def __init__(self, prompts, block_size=4):
        self.requests = {k: _Req(p) for k, p in prompts.items()}
        self.cache_config = type("C", (), {"block_size": block_size})()


def _capture(runner=None):
    cap = RouteCapture.__new__(RouteCapture)
    cap.layer_ids, cap.topk, cap.dtype = [1, 2], 2, np.uint8
    cap.prefix = PrefixRoutes(runner) if runner is not None else None
    cap.step, cap.per_request, cap.rows, cap.missing_layers, cap.missing_rows = {}, {}, {}, {}, {}
    return cap


def _step(cap, req_ids, lens, starts, layers=(1, 2), seed=0):
    n = sum(lens)
    g = torch.Generator().manual_seed(seed)
    cap.step = {l: torch.randint(0, 8, (n, 2), generator=g) for l in layers}
    cap._split(req_ids, np.cumsum([0] + list(lens)), np.array(starts))


def test_complete_routes_concatenate_over_steps():
    cap = _capture()
    _step(cap, ["a-1", "b-2"], [5, 3], [0, 0])
    _step(cap, ["a-1", "b-2"], [1, 1], [5, 3], seed=1)
    out = cap.pop(["a", "b"])
    assert out["a"].shape == (6, 2, 2) and out["b"].shape == (4, 2, 2) and out["a"].dtype == np.uint8
    with pytest.raises(ValueError, match="no unique captured routes for request 'a'"):
        cap.pop(["a"])                                          # consumed once


def test_missing_layer_and_rows_are_errors_at_pop():
    cap = _capture()
    _step(cap, ["a-1"], [5], [0], layers=(1,))
    with pytest.raises(ValueError, match=r"request 'a'.*MoE layers \[2\] did not report"):
        cap.pop(["a"])
    cap = _capture()
    _step(cap, ["b-1"], [3], [4])                               # rows 0..3 never forwarded, no prefix store
    with pytest.raises(ValueError, match=r"request 'b'.*token rows 0\.\.3 were never captured"):
        cap.pop(["b"])


def test_prefix_store_fills_cached_prompt_blocks():
    prompt = list(range(10))
    runner = _Runner({"a-1": prompt, "b-2": prompt, "c-3": [9] * 10})
    cap = _capture(runner)
    # a computes the whole prompt; b (same step) starts after 8 cached tokens (2 blocks of 4); c has no stored prefix
    _step(cap, ["b-2", "a-1", "c-3"], [2, 10, 2], [8, 0, 8])
    assert cap.prefix.hits == 1
    out = cap.pop(["a", "b"])
    assert out["b"].shape == (10, 2, 2)
    np.testing.assert_array_equal(out["b"][:8], out["a"][:8])
    with pytest.raises(ValueError, match=r"request 'c'.*token rows 0\.\.7"):
        cap.pop(["c"])
    cap.new_weights()                                           # a new adapter: stored prompt routes are stale
    assert not cap.prefix.by_key
