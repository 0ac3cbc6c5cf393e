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


def test_discard_drops_partial_routes_so_an_id_can_start_again():
    cap = _capture()
    _step(cap, ["a-1", "b-2"], [5, 3], [0, 0])
    _step(cap, ["a-1"], [1], [9])                               # a gap: rows 5..8 never forwarded
    assert cap.discard(["a", "zz"]) == 1                        # unknown ids are ignored
    _step(cap, ["a-3"], [4], [0], seed=2)                       # the id again, fresh (an aborted request resubmitted)
    out = cap.pop(["a", "b"])
    assert out["a"].shape == (4, 2, 2) and out["b"].shape == (3, 2, 2)
    assert not cap.per_request and not cap.missing_rows


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


def test_prefix_store_keyed_by_version():
    """A prompt's stored routes serve only requests of the same cache salt (adapter version); a commit drops the
    entries of versions no longer held and the untracked ones, and keeps those of versions still held."""
    from moe_lora_rl.vllm.versions import UNTRACKED_SALT, cache_salt

    prompt = list(range(8))
    names = ("a-1", "b-2", "c-3", "u-4", "v-5", "d-6")
    runner = _Runner({k: prompt for k in names})
    salts = {"a-1": cache_salt(5), "b-2": cache_salt(5), "c-3": cache_salt(6), "d-6": cache_salt(5),
             "u-4": UNTRACKED_SALT, "v-5": UNTRACKED_SALT}
    cap = _capture(runner)
    cap.prefix.salt_of = salts.__getitem__
    _step(cap, ["a-1", "u-4"], [8, 8], [0, 0])                 # version 5 and an untracked request compute it
    _step(cap, ["b-2", "c-3", "v-5"], [1, 1, 1], [8, 8, 8], seed=1)
    assert cap.prefix.hits == 2                                  # b from a's routes, v from u's; c (version 6): none
    out = cap.pop(["a", "b", "u", "v"])
    np.testing.assert_array_equal(out["b"][:8], out["a"][:8])
    np.testing.assert_array_equal(out["v"][:8], out["u"][:8])
    assert not np.array_equal(out["a"][:8], out["u"][:8])       # the two salts held different routes
    with pytest.raises(ValueError, match=r"request 'c'.*token rows 0\.\.7"):
        cap.pop(["c"])
    cap.new_weights({cache_salt(5), cache_salt(None)})          # version 6 committed, 5 still held (pinned requests)
    assert {salt for salt, _ in cap.prefix.by_key.values()} == {cache_salt(5)}
    _step(cap, ["d-6"], [1], [8], seed=2)                       # a pinned request of 5 prefilling after the commit
    np.testing.assert_array_equal(cap.pop(["d"])["d"][:8], out["a"][:8])
    cap.new_weights({cache_salt(6)})                             # 5 freed
    assert not cap.prefix.by_key


def test_prefix_store_dropped_when_a_new_base_serves():
    """The base salt is one string across base syncs: the worker drops every stored prompt route (base-salted and
    untracked) when a new base serves, so a prompt prefilled again under base B is never given base A's routes.
    Control: the store as it was before the base served still hits (it would serve A's routes)."""
    from moe_lora_rl.vllm.versions import UNTRACKED_SALT, cache_salt
    from moe_lora_rl.vllm.worker_ext import MoELoRAWorkerExtension

    prompt = list(range(8))
    runner = _Runner({k: prompt for k in ("a-1", "u-2", "b-3")})
    salts = {"a-1": cache_salt(None), "u-2": UNTRACKED_SALT, "b-3": cache_salt(None)}
    cap = _capture(runner)
    cap.prefix.salt_of = salts.__getitem__
    _step(cap, ["a-1", "u-2"], [8, 8], [0, 0])                  # base A computes the prompt (base salt, untracked)
    assert {salt for salt, _ in cap.prefix.by_key.values()} == {cache_salt(None), UNTRACKED_SALT}
    assert cap.prefix.lookup("b-3", 0, 8) is not None            # control: before the new base, a hit
    worker = type("W", (), {"_moe_lora_capture": cap})()        # no adapter runtime: the base alone
    MoELoRAWorkerExtension._moe_lora_base_served(worker)         # base B serves (ShmBaseEngine.on_served)
    assert not cap.prefix.by_key and cap.prefix.lookup("b-3", 0, 8) is None


class _Batch:
    def __init__(self, req_ids, lens):
        self.num_reqs, self.req_ids = len(req_ids), list(req_ids)
        self.num_computed_tokens_cpu = np.zeros(len(req_ids), dtype=np.int64)
        self.qsl = np.cumsum([0] + list(lens))


class _StepRunner:
    """A model runner with the attributes step_hooks reads and a forward that reports routes like a router."""

    def __init__(self):
        self.input_batch = _Batch(["a-1"], [3])
        self.query_start_loc = type("B", (), {"np": self.input_batch.qsl})()
        self.report, self.fail = None, False

    def _model_forward(self, x):
        if self.report is not None:
            self.report()
        if self.fail:
            raise RuntimeError("forward failed")
        return x + 1


class _Recorder:
    def __init__(self):
        self.calls = []

    def before(self, info):
        self.calls.append(("before", info.req_ids, info.num_tokens))

    def after(self, info):
        self.calls.append(("after", info.failed))


def test_step_listeners_are_independent():
    """Capture and the LoRA runtime each register a listener on the one wrapper of _model_forward: stopping the
    capture leaves the other listener (and the wrapper) in place; a failed forward reaches `after` as failed and
    captures nothing."""
    from moe_lora_rl.vllm.step_hooks import add_listener, remove_listener

    runner = _StepRunner()
    cap = _capture()
    cap.runner, cap.routers = runner, []
    routes = {1: torch.ones(3, 2, dtype=torch.long), 2: torch.zeros(3, 2, dtype=torch.long)}
    runner.report = lambda: cap.step.update(routes)
    other = _Recorder()
    cap.start()
    add_listener(runner, other)
    wrapper = runner._model_forward
    assert wrapper(1) == 2 and other.calls == [("before", ["a-1"], 3), ("after", False)]
    assert cap.rows == {"a-1": 3} and cap.step == {}
    runner.fail = True
    with pytest.raises(RuntimeError, match="forward failed"):
        runner._model_forward(1)
    assert other.calls[-1] == ("after", True) and cap.rows == {"a-1": 3} and cap.step == {}
    runner.fail = False
    cap.stop()
    assert runner._model_forward is wrapper                      # the runtime's listener is still called
    runner._model_forward(1)
    assert other.calls[-2:] == [("before", ["a-1"], 3), ("after", False)] and cap.rows == {"a-1": 3}
    cap.start()                                                  # a restarted capture sees the next step again
    remove_listener(runner, other)
    n = len(other.calls)
    runner.input_batch.num_computed_tokens_cpu[0] = 3            # the request continues after its 3 rows
    runner._model_forward(1)
    assert len(other.calls) == n and cap.rows == {"a-1": 6}


class _Router:
    def set_capture_fn(self, fn):
        self.fn = fn


def _moe_model(names):
    model = torch.nn.Module()
    for name in names:                           # e.g. "model.layers.0.mlp": a module with a .router
        parent = model
        for bit in name.split("."):
            if not hasattr(parent, bit):
                parent.add_module(bit, torch.nn.Module())
            parent = getattr(parent, bit)
        parent.router = _Router()
    return model


def test_two_routers_on_one_layer_number_are_refused():
    """An MTP (or draft) layer numbered like a decoder layer would overwrite that layer's captured routes (the fault
    of other systems: MTP layer k replaying decoder layer k's routes, a draft router overwriting layer 0's capture)."""
    from moe_lora_rl.vllm.capture import find_routers

    decoder = ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert [l for l, _ in find_routers(_moe_model(decoder))] == [0, 1]
    with pytest.raises(ValueError, match=r"modules 'model.layers.0.mlp' and 'mtp.layers.0.mlp' both are MoE layer 0"):
        find_routers(_moe_model([*decoder, "mtp.layers.0.mlp"]))


def test_capture_refuses_speculative_decoding():
    cfg = type("Cfg", (), {"compilation_config": type("C", (), {"mode": 0})(), "model_config": None,
                           "speculative_config": object()})()
    runner = type("Runner", (), {"vllm_config": cfg})()
    with pytest.raises(ValueError, match="routing capture with speculative decoding"):
        RouteCapture(runner)
