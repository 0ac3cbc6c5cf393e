"""The Megatron run config: what a cuda + bf16 + Transformer Engine config asks of megatron-core (pure kwargs, no GPU
faked: only what the builders return and what megatron-core's own TransformerConfig accepts), that it applies no CPU
shim, and one-line ValueErrors for values the config or this machine cannot run, before any process group."""
import datetime

import pytest
import torch

from moe_lora_rl.megatron import run_config as rcm
from moe_lora_rl.megatron.build import transformer_config_kwargs
from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.megatron.run_config import RunConfig


@pytest.fixture(scope="module")
def arch():
    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.models import get_model

    return load_arch(get_model("glm4_moe"))


GPU = RunConfig(device="cuda", dtype="bf16", layer_spec="te")


def test_cuda_bf16_te_kwargs(arch):
    assert (GPU.backend, GPU.cpu_init, GPU.grads_fp32, GPU.adapter_dtype) == (rcm.MIXED, False, True, "fp32")
    assert rcm.transformer_kwargs(GPU) == {
        "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16, "bf16": True, "fp16": False,
        "use_cpu_initialization": False, "perform_initialization": False, "moe_router_dtype": "fp32",
        "moe_grouped_gemm": True, "gradient_accumulation_fusion": False}
    assert rcm.spec_kwargs(GPU) == {"use_transformer_engine": True, "normalization": "RMSNorm"}
    assert rcm.process_group_kwargs(GPU) == {"backend": "cpu:gloo,cuda:nccl",
                                                 "timeout": datetime.timedelta(minutes=10)}
    assert rcm.parallel_state_kwargs(GPU) == {"create_gloo_process_groups": False}
    assert rcm.ddp_kwargs(GPU) == {"grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
                                   "use_distributed_optimizer": False, "check_for_nan_in_grad": True}
    assert rcm.host_shims(GPU) == ()
    # the full TransformerConfig arguments: the run config's entries win over the model-derived ones, and
    # megatron-core's own validation accepts them (its __post_init__ checks no device)
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    kw = transformer_config_kwargs(arch, Layout(tp=2, ep=2), GPU)
    for k, v in rcm.transformer_kwargs(GPU).items():
        assert kw[k] == v, k
    assert kw["sequence_parallel"] and kw["moe_token_dispatcher_type"] == "alltoall"
    cfg = TransformerConfig(**kw)
    assert cfg.bf16 and cfg.params_dtype is torch.bfloat16 and cfg.moe_grouped_gemm and not cfg.use_cpu_initialization
    assert DistributedDataParallelConfig(**rcm.ddp_kwargs(GPU)).grad_reduce_in_fp32


def test_cpu_defaults_and_shim_is_the_callers():
    cpu = RunConfig()
    assert (cpu.backend, cpu.cpu_init, cpu.dtype, cpu.layer_spec) == ("gloo", True, "fp32", "local")
    assert rcm.host_shims(cpu) == ("cpu_support",)
    assert rcm.transformer_kwargs(RunConfig(dtype="bf16"))["params_dtype"] is torch.bfloat16
    assert RunConfig.from_dict(GPU.to_dict()) == GPU


def test_cuda_on_the_local_spec_takes_the_router_fix_alone():
    assert rcm.host_shims(RunConfig(device="cuda", dtype="bf16")) == ("te_gemm_fix",)


def test_te_gemm_fix_binds_the_missing_name_and_restores(monkeypatch):
    """megatron-core 0.16.1 without TE: the router reads moe_utils.te_general_gemm, imported only with TE (a
    NameError at the first router forward on CUDA, seen on an H100); the fix binds it to None, restore() unbinds."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe import moe_utils

    from moe_lora_rl.megatron import te_gemm_fix
    from moe_lora_rl.megatron.cpu_support import mcore_version

    assert te_gemm_fix.needed("0.16.1", SimpleNamespace()) and not te_gemm_fix.needed("0.19.2", SimpleNamespace())
    assert not te_gemm_fix.needed("0.16.1", SimpleNamespace(te_general_gemm=None))       # TE installed: nothing
    if not mcore_version().startswith("0.16."):
        pytest.skip("megatron-core 0.16 only")
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)          # as on a CUDA host without TE
    handle = te_gemm_fix.apply()
    assert handle is not None and moe_utils.te_general_gemm is None
    assert te_gemm_fix.apply() is None                                        # applied: nothing more to do
    handle.restore()
    assert not hasattr(moe_utils, "te_general_gemm")


def test_building_the_gpu_kwargs_applies_nothing(monkeypatch, arch):
    from moe_lora_rl.megatron import cpu_support

    monkeypatch.setattr(cpu_support, "apply", lambda: pytest.fail("CPU support applied for a cuda config"))
    before = (torch.cuda.current_device, torch.cuda.Stream, cpu_support.active())
    transformer_config_kwargs(arch, Layout(), GPU)
    rcm.spec_kwargs(GPU), rcm.process_group_kwargs(GPU), rcm.ddp_kwargs(GPU)
    assert (torch.cuda.current_device, torch.cuda.Stream, cpu_support.active()) == before


@pytest.mark.parametrize("kw,match", [
    ({"device": "tpu"}, "device='tpu'"),
    ({"dtype": "fp16"}, "dtype='fp16'"),
    ({"dtype": "float8"}, "dtype='float8'"),
    ({"backend": "mpi"}, "backend='mpi'"),
    ({"layer_spec": "kitchen"}, "layer_spec='kitchen'"),
    ({"backend": "nccl"}, "backend='nccl': a group with NCCL alone has no backend for the CPU tensors"),
    ({"device": "cuda", "backend": "nccl"}, "use backend='cpu:gloo,cuda:nccl'"),
    ({"backend": "cpu:gloo,cuda:nccl"}, "backend='cpu:gloo,cuda:nccl' needs device='cuda'"),
    ({"layer_spec": "te"}, "layer_spec='te' with device='cpu'"),
    ({"device": "cuda", "backend": "gloo"}, "backend='gloo' with device='cuda'"),
    ({"cpu_init": False}, "cpu_init=False with device='cpu'"),
])
def test_bad_values_named(kw, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_machine_without_cuda_refused_before_any_process_group():
    import torch.distributed as dist

    from moe_lora_rl.megatron.parallel import init_distributed

    was = dist.is_initialized()
    with pytest.raises(ValueError, match="device='cuda': this machine has no CUDA device"):
        GPU.check_host()
    with pytest.raises(ValueError, match="device='cuda': this machine has no CUDA device"):
        init_distributed(Layout(), RunConfig(device="cuda", dtype="bf16"))
    assert dist.is_initialized() == was


def test_grouped_experts_on_cuda_need_bf16(arch):
    from moe_lora_rl.megatron.build import build_model
    from moe_lora_rl.megatron.cpu_support import mcore_version

    if not mcore_version().startswith("0.16."):
        pytest.skip("the legacy GroupedMLP exists in megatron-core 0.16 only")
    with pytest.raises(ValueError, match="dtype='fp32' on cuda: the grouped_gemm kernel is bf16-only"):
        build_model(arch, Layout(), RunConfig(device="cuda"), grouped_experts=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusals of a machine without CUDA")
def test_bench_refuses_bad_values_in_one_line(capsys):
    from moe_lora_rl.bench import parity

    for argv, match in ((["--device", "cuda"], "device='cuda'"), (["--dtype", "fp16"], "dtype='fp16'")):
        with pytest.raises(SystemExit) as e:
            parity.main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and match in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusals of a machine without CUDA")
def test_lora_bench_refuses_bf16_timing_it_cannot_honour(capsys):
    from moe_lora_rl.bench import lora

    with pytest.raises(SystemExit) as e:
        lora.main(["--dtype", "bf16"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--dtype bf16 with step times" in err, err
