"""Fixtures shared by the vLLM engine tests: the tiny glm4_moe checkpoint and its architecture (a module that
needs another model defines its own `model`)."""
import pytest


@pytest.fixture(scope="module")
def model():
    from moe_lora_rl.models import get_model

    return str(get_model("glm4_moe", "tiny"))


@pytest.fixture(scope="module")
def arch(model):
    import transformers

    from moe_lora_rl.models.arch import arch_from_hf_config

    return arch_from_hf_config(transformers.AutoConfig.from_pretrained(model))
