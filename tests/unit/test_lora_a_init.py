"""LoRA A's initialisation (LoRAConfig.a_init; verl's model.lora.lora_A_init_method): kaiming-uniform over fan_in
(PEFT's, nn.Linear's) or xavier-uniform over fan_in + rank (Megatron-Bridge's "xavier", verl's default), drawn from
the factor's global name (layout-independent), B zero either way; anything else refused."""
import math

import pytest
import torch

from moe_lora_rl.lora.config import LoRAConfig
from moe_lora_rl.lora.layers import FactorMeta, make_factor


def _a(init, shape=(8, 512), seed=0):
    meta = FactorMeta("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.lora_A", shape, None, None, ())
    return make_factor(meta, 0, 1, init=init, seed=seed, dtype=torch.float32).data


def test_bounds_follow_the_method():
    r, fan_in = 8, 512
    k, x = _a("kaiming"), _a("xavier")
    kb, xb = 1 / math.sqrt(fan_in), math.sqrt(6 / (fan_in + r))
    assert k.abs().max() <= kb and k.abs().max() > 0.95 * kb
    assert x.abs().max() <= xb and x.abs().max() > 0.95 * xb
    # the same seeded draw scaled: the two methods differ only by the bound (control: they are not equal)
    assert torch.allclose(x, k * (xb / kb), atol=1e-6) and not torch.allclose(x, k)


@pytest.mark.verl
def test_verl_key_reaches_the_config_and_bad_values_are_refused():
    from moe_lora_rl.integration.verl.verl_config import lora_config

    assert lora_config({"rank": 4, "lora_A_init_method": "xavier"}).a_init == "xavier"
    assert lora_config({"rank": 4}).a_init == "kaiming"
    with pytest.raises(ValueError, match=r"lora_A_init_method='normal'"):
        lora_config({"rank": 4, "lora_A_init_method": "normal"})
    with pytest.raises(ValueError, match=r"a_init='normal'"):
        LoRAConfig(rank=4, a_init="normal")
    with pytest.raises(ValueError, match=r"init='normal'"):
        _a("normal")
