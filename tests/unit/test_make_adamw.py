"""policy/step.make_adamw: the multi-tensor AdamW on fp32 adapters steps them bit for bit like the loop over
tensors (weight decay, clipped-size and lr=0 steps); on bf16 factors, where the two differ (the control that the
comparison can fail), torch's default is kept."""
import pytest
import torch

from moe_lora_rl.policy.optimizer_step import make_adamw


def _run(dtype, lr, foreach):
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(8, 64, generator=g).to(dtype).requires_grad_() for _ in range(40)]
    opt = make_adamw(ps, lr=lr, weight_decay=0.01, betas=(0.9, 0.99), **({} if foreach is None else
                                                                         {"foreach": foreach}))
    for step in range(4):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 10.0 ** (step - 2)).to(dtype)
        opt.step()
    return opt, ps


@pytest.mark.parametrize("lr", [3e-3, 0.0])
def test_fp32_adapters_step_with_foreach_bit_for_bit(lr):
    chosen, got = _run(torch.float32, lr, None)
    assert chosen.param_groups[0]["foreach"] is True
    _, want = _run(torch.float32, lr, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bf16_adapters_keep_torchs_default():
    chosen, got = _run(torch.bfloat16, 3e-3, None)
    assert chosen.param_groups[0]["foreach"] is None
    _, loop = _run(torch.bfloat16, 3e-3, False)
    _, multi = _run(torch.bfloat16, 3e-3, True)
    assert all(torch.equal(a, b) for a, b in zip(got, loop))
    assert not all(torch.equal(a, b) for a, b in zip(multi, loop))   # why foreach is not chosen for bf16
