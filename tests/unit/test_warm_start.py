"""Warm start: the supervised batch masks everything but the answer, and training is deterministic from the seed."""
import dataclasses

import pytest
import torch

from moe_lora_rl.data.task import Problem, TaskSpec
from moe_lora_rl.data.warm_start import WarmStartSpec, sft_batch, train


@pytest.fixture(scope="module")
def tiny():
    import transformers

    from moe_lora_rl.models import get_model

    path = get_model("glm4_moe", "tiny")
    return path, transformers.AutoTokenizer.from_pretrained(path)


def test_sft_batch_labels_only_the_answer(tiny):
    _, tok = tiny
    ids, mask, labels = sft_batch(tok, [Problem((3, 1, 4, 1, 5), 0), Problem((9, 2, 6, 5, 3), 1)])
    for i, ans in enumerate(["1 1 3 4 5", "2 3 5 6 9"]):
        kept = labels[i][labels[i] != -100].tolist()
        assert tok.decode(kept) == ans + "<|im_end|>"
        n = int(mask[i].sum())
        assert (labels[i, :n] != -100).sum() == len(kept) and (labels[i, n:] == -100).all()
        assert ids[i, n - len(kept):n].tolist() == kept        # the answer closes the sequence


def _weights_after(path, tok, spec):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.set_num_threads(1)
    info = train(model, tok, spec)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), info


def test_train_deterministic_from_seed(tiny):
    path, tok = tiny
    spec = WarmStartSpec(task=TaskSpec(length=5, n_eval=64), steps=3, batch_size=4)
    w1, info = _weights_after(path, tok, spec)
    w2, _ = _weights_after(path, tok, spec)
    assert torch.equal(w1, w2) and info["steps"] == 3 and info["final_loss"] > 0
    w3, _ = _weights_after(path, tok, dataclasses.replace(spec, seed=1))
    assert not torch.equal(w1, w3)                              # negative control: another seed, other batches


def test_spec_validation():
    with pytest.raises(ValueError, match="steps=0"):
        WarmStartSpec(steps=0)
    assert WarmStartSpec().key() != WarmStartSpec(steps=401).key()


def test_frozen_routers_and_bias_balancing(tiny):
    """router_lr_scale=0 leaves the routers' weights as initialised while everything else trains; bias_update moves
    each expert bias by exactly that much per step, down for the experts above the mean load (DeepSeek-V3's
    aux-loss-free balancing). Control: without balancing the biases stay put."""
    import transformers

    path, tok = tiny
    spec = WarmStartSpec(task=TaskSpec(length=5, n_eval=64), steps=2, batch_size=4, router_lr_scale=0.0,
                         bias_update=0.01)
    init = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    torch.set_num_threads(1)
    train(model, tok, spec)
    before = dict(init.named_parameters())
    for name, p in model.named_parameters():
        frozen = name.endswith("mlp.gate.weight")
        assert torch.equal(p, before[name]) == frozen, name
    bias0 = dict(init.named_buffers())
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            steps = (b - bias0[name]) / 0.01
            assert torch.allclose(steps, steps.round(), atol=1e-4)       # whole steps of 0.01
            assert 0.5 < steps.abs().max() <= 2 + 1e-4
    assert len(routers[0]._forward_hooks) == 0                   # train() removed its own hooks
    control = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    train(control, tok, dataclasses.replace(spec, bias_update=0.0))
    assert all(torch.equal(b, bias0[n]) for n, b in control.named_buffers() if n.endswith("e_score_correction_bias"))


def test_balance_moves_bias_against_load():
    from moe_lora_rl.data.warm_start import _balance

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("e_score_correction_bias", torch.zeros(4))

    r = Router()
    load = torch.tensor([5.0, 1.0, 3.0, 3.0])                      # mean 3
    _balance([r], [load], 0.1)
    assert r.e_score_correction_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    assert load.sum() == 0                                          # the counters restart


def test_default_spec_keys_are_stable():
    """Adding the router options did not change the cache key of the former default's warm start."""
    from moe_lora_rl.data.warm_start import default_spec

    assert WarmStartSpec().key() == "09ae454a10" == default_spec("small").key()
    wide = default_spec("wide")
    assert (wide.router_lr_scale, wide.bias_update) == (0.0, 0.01) and wide.key() != WarmStartSpec().key()
    with pytest.raises(ValueError, match="router_lr_scale=-1"):
        WarmStartSpec(router_lr_scale=-1)


def test_router_options_refused_without_biased_routers():
    import transformers

    from moe_lora_rl.models import get_model

    path = get_model("qwen3_moe", "tiny")                         # softmax routers: no expert bias to balance
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with pytest.raises(ValueError, match=r"bias_update=0.01: Qwen3MoeForCausalLM has no router with an expert bias"):
        train(model, tok, WarmStartSpec(steps=1, batch_size=2, bias_update=0.01))
