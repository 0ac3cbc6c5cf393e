import pytest
import torch

from moe_lora_rl.megatron import cpu_support


def test_apply_is_explicit_idempotent_and_restorable():
    before = torch.cuda.current_device
    assert cpu_support._ACTIVE is None or cpu_support._ACTIVE.patched    # nothing applied at import
    h = cpu_support.apply()
    assert cpu_support.apply() is h
    assert torch.cuda.current_device() == "cpu"
    from megatron.core.tensor_parallel import mappings
    assert mappings._gather_along_first_dim is cpu_support._gather_along_first_dim
    h.restore()
    assert torch.cuda.current_device is before
    assert mappings._gather_along_first_dim is not cpu_support._gather_along_first_dim


def test_untested_version_refused(monkeypatch):
    monkeypatch.setattr(cpu_support, "mcore_version", lambda: "0.12.0")
    monkeypatch.setattr(cpu_support, "_ACTIVE", None)
    with pytest.raises(RuntimeError, match="megatron-core 0.12.0 is untested"):
        cpu_support.apply()


def test_device_mode_rewrites_cuda_kwargs():
    h = cpu_support.apply()
    try:
        with h.cuda_device_kwargs_to_cpu():
            t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu"
    finally:
        h.restore()
