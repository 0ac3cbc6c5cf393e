"""The policy batch built from rollout samples: token layout, label positions, GRPO advantages, route checks."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
from moe_lora_rl.rl.batching import policy_batch  # noqa: E402


def sample(prompt, response, routes=True, n_moe=2, topk=2):
    n = len(prompt) + len(response) - 1
    r = np.arange(n * n_moe * topk).reshape(n, n_moe, topk) % 8 if routes else None
    return SimpleNamespace(prompt=prompt, response=response, logprobs=[-0.1 * (k + 1) for k in range(len(response))],
                           routes=r, finish_reason="stop")


def build(samples, rewards, groups, **kw):
    return policy_batch(samples, rewards, groups, 0, moe_layers=(1, 2), num_experts=8, topk=2, **kw)


def test_layout_positions_and_advantages():
    s = [sample([5, 6, 7], [8, 9]), sample([5, 6, 7], [8]), sample([4, 4, 4], [1, 2, 3]), sample([4, 4, 4], [2])]
    b = build(s, [1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    assert b.tokens.tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 0, 0], [4, 4, 4, 1, 2, 3], [4, 4, 4, 2, 0, 0]]
    assert b.lengths == [5, 4, 6, 4]
    # label position t predicts tokens[t + 1]: a response after a 3-token prompt starts at position 2
    assert b.loss_mask.tolist()[0] == [False, False, True, True, False]
    assert b.loss_mask.tolist()[2] == [False, False, True, True, True]
    assert torch.equal(b.rollout_logprobs[0, 2:4], torch.tensor([-0.1, -0.2]))
    assert (b.rollout_logprobs[~b.loss_mask] == 0).all() and (b.advantages[~b.loss_mask] == 0).all()
    # GRPO: (r - mean) / (std + eps) within each prompt's group, unbiased std; a group of equal rewards gets 0
    want = 0.5 / (torch.tensor([1.0, 0.0]).std().item() + 1e-6)
    assert b.advantages[0, 2:4].tolist() == pytest.approx([want, want], rel=1e-6)
    assert b.advantages[1, 2].item() == pytest.approx(-want, rel=1e-6)
    assert b.advantages[2:].abs().max().item() == 0.0
    assert [r.shape for r in b.routes.samples] == [(4, 2, 2), (3, 2, 2), (5, 2, 2), (3, 2, 2)]
    assert b.routes.layer_ids == (1, 2)


def test_bad_input_is_named():
    good = sample([1, 2], [3])
    with pytest.raises(ValueError, match="empty response"):
        build([good, sample([1, 2], [])], [0, 1], [0, 0])
    short = sample([1, 2], [3, 4])
    short.routes = short.routes[:-1]
    with pytest.raises(ValueError, match="sample 1: routes cover 2 tokens"):
        build([good, short], [0, 1], [0, 0])
    with pytest.raises(ValueError, match="without routes"):
        build([good, sample([1, 2], [3], routes=False)], [0, 1], [0, 0])
    assert build([good, sample([1, 2], [3], routes=False)], [0, 1], [0, 0], with_routes=False).routes is None
    bad_lp = sample([1, 2], [3, 4])
    bad_lp.logprobs = [0.0]
    with pytest.raises(ValueError, match="1 rollout logprobs for 2 response tokens"):
        build([good, bad_lp], [0, 1], [0, 0])
    wild = sample([1, 2], [3])
    wild.routes = wild.routes + 100
    with pytest.raises(ValueError, match="out of range"):
        build([good, wild], [0, 1], [0, 0])
