import pytest


@pytest.fixture(scope="session")
def qwen():
    """A factory of tiny Qwen3-MoE Megatron models on a single-rank gloo world (in this process)."""
    import torch.distributed as dist

    from moe_lora_rl.megatron.build import build_model
    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.megatron.layout import Layout
    from moe_lora_rl.megatron.hf_load import load_hf_weights
    from moe_lora_rl.megatron.parallel import init_distributed, teardown
    from moe_lora_rl.megatron.run_config import RunConfig, prepare_host
    from moe_lora_rl.models import get_model

    rc = RunConfig()
    prepare_host(rc)                  # once for the session; tests that restore() the CPU support re-apply it
    init_distributed(Layout(), rc)
    path = get_model("qwen3_moe")
    arch = load_arch(path)

    def make(rc=rc, **kw):
        prepare_host(rc)
        m = build_model(arch, Layout(), rc, **kw)
        load_hf_weights(m, path, arch)
        return m
    make.arch = arch
    yield make
    teardown()
    dist.destroy_process_group()

