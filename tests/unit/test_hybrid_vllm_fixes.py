"""The two CPU fixes vLLM 0.32 needs for the hybrid family, in one process (their effect on a served model:
tests/e2e/test_hybrid_vllm.py).

- vllm/vision_import_fix.py: needed only for an architecture of vLLM's qwen3_5 module on CPU without torchvision;
  scoped() makes vLLM's qwen3_5 module importable and leaves vLLM's registry and sys.modules as they were
- vllm/gdn_torch.py: which delta-net layers vLLM's CPU kernels cannot run (fp32; head widths other than 64 / 128)
"""
import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from moe_lora_rl.vllm import gdn_torch, vision_import_fix


def test_vision_fix_needed_only_for_qwen3_5_on_cpu_without_torchvision():
    from moe_lora_rl.models import get_model

    no_tv = importlib.util.find_spec("torchvision") is None
    for family, size, want in (("qwen3_5_moe", "tiny", True), ("qwen3_5_moe", "tiny_vl", True),
                               ("qwen3_next", "tiny", False), ("glm4_moe", "tiny", False)):
        path = get_model(family, size)
        assert vision_import_fix.needed(path, cpu=True) == (want and no_tv), (family, size)
        assert not vision_import_fix.needed(path, cpu=False)


@pytest.mark.vllm
def test_vision_fix_scoped_imports_qwen3_5_and_restores():
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision installed: nothing to fix")
    from vllm.model_executor.models import registry

    from moe_lora_rl.models import get_model

    runner, had = registry._run_in_subprocess, sys.modules.get(vision_import_fix.IMAGE_MODULE)
    with vision_import_fix.scoped(get_model("qwen3_5_moe", "tiny"), cpu=True) as applied:
        assert applied and registry._run_in_subprocess is not runner
        import vllm.model_executor.models.qwen3_5 as q

        assert q.Qwen3_5MoeForCausalLM.__name__ == "Qwen3_5MoeForCausalLM"
    assert registry._run_in_subprocess is runner
    assert sys.modules.get(vision_import_fix.IMAGE_MODULE) is had


def _layer(dtype, k, v):
    return SimpleNamespace(in_proj_qkvz=SimpleNamespace(weight=torch.zeros(1, dtype=dtype)), head_k_dim=k, head_v_dim=v)


def test_torch_core_where_the_kernels_cannot_run():
    assert not gdn_torch.needs_torch(_layer(torch.bfloat16, 128, 128))      # the released checkpoints
    assert not gdn_torch.needs_torch(_layer(torch.bfloat16, 64, 64))
    assert gdn_torch.needs_torch(_layer(torch.float32, 128, 128))           # "CPU GDN attention requires BF16."
    assert gdn_torch.needs_torch(_layer(torch.bfloat16, 32, 32))            # "Unexpected head dim size, 32"
    assert gdn_torch.needs_torch(_layer(torch.bfloat16, 128, 256))
