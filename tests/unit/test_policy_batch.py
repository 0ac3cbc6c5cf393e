"""PolicyBatch validation (pure) and switching adapters off (in process, tiny Qwen3-MoE)."""
import dataclasses

import pytest
import torch

from moe_lora_rl.policy.core import PolicyBatch


def _batch(**kw):
    n, s = 2, 6
    lengths = [6, 4]
    mask = torch.zeros(n, s - 1, dtype=torch.bool)
    mask[0, 2:5] = True
    mask[1, 2:3] = True
    d = dict(tokens=torch.ones(n, s, dtype=torch.long), lengths=lengths, loss_mask=mask,
             advantages=torch.zeros(n, s - 1), rollout_logprobs=None, routes=None, group_ids=[0, 0])
    d.update(kw)
    return PolicyBatch(**d)


def test_policy_batch_checks_name_the_value():
    b = _batch()
    assert b.label_mask().tolist() == [[True] * 5, [True, True, True, False, False]]
    with pytest.raises(ValueError, match=r"tokens must be an int64 \[N, S\] tensor, got torch.float32 \(2, 6\)"):
        _batch(tokens=torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"lengths \[6, 7\] must be 2 values in 2..6"):
        _batch(lengths=[6, 7])
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 6\), expected \(2, 5\)"):
        _batch(advantages=torch.zeros(2, 6))
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(2, 4\), expected \(2, 5\)"):
        _batch(rollout_logprobs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="1 group ids for 2 rows"):
        _batch(group_ids=[0])
    bad = b.loss_mask.clone()
    bad[1, 3] = True
    with pytest.raises(ValueError, match=r"loss_mask is True at row 1, position 3: beyond the row's last label "
                                         r"\(length 4\)"):
        dataclasses.replace(b, loss_mask=bad)


def test_adapters_disabled_gives_the_base_exactly(qwen):
    from moe_lora_rl.lora import LoRAConfig, adapter_factors, adapters_disabled, apply_lora
    from moe_lora_rl.megatron.forward import forward_logits

    m = qwen()
    tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    base = forward_logits(m, tokens, 512)
    apply_lora(m, LoRAConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        for _, p in adapter_factors(m):
            p.add_(0.1)                                        # nonzero B: the adapters change the output
    adapted = forward_logits(m, tokens, 512)
    with adapters_disabled(m):
        off = forward_logits(m, tokens, 512)
    again = forward_logits(m, tokens, 512)
    assert torch.equal(off, base)
    assert (adapted - base).abs().max() > 1e-3                # negative control: the adapters do matter
    assert torch.equal(again, adapted)                        # restored on exit
    with pytest.raises(ValueError, match="has no LoRA adapters to disable"):
        with adapters_disabled(qwen()):
            pass
