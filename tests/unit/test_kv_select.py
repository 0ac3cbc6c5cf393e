"""Importance-based KV eviction, the pure part (vllm/kv_select.py): the policy's refusals, the scores against an
explicit loop over queries and heads, and the selection against a brute-force ranking."""
import math

import pytest
import torch

from moe_lora_rl.vllm.kv_select import EvictPolicy, compress_due, fits, scores, select


@pytest.mark.parametrize("kw, needle", [
    (dict(budget=36, sinks=4, recent=32), "kv_budget=36 is not above the sinks plus the recent window (4 + 32)"),
    (dict(budget=20, sinks=0, recent=20), "kv_budget=20 is not above"),
    (dict(budget=96, interval=0), "interval=0 is below 1"),
    (dict(budget=40, sinks=0, recent=8, window=41), "window=41 (observation window) is larger than the budget 40"),
    (dict(budget=96, recent=16, window=17), "window=17 is larger than the recent window 16"),
    (dict(budget=96, pool=4), "pool=4 must be an odd kernel"),
    (dict(budget=96, recent=0), "recent=0"),
    (dict(budget=96.0), "budget=96.0 is not an integer"),
])
def test_policy_refuses_bad_settings_naming_the_value(kw, needle):
    with pytest.raises(ValueError) as e:
        EvictPolicy(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_policy_counts():
    pol = EvictPolicy(budget=96, sinks=4, recent=32)
    assert (pol.chosen, pol.compacted) == (60, 64)
    assert not compress_due(pol, 96, None) and compress_due(pol, 97, None)
    assert not compress_due(pol, 110, 15) and compress_due(pol, 110, 16)
    assert fits(pol, 96, 32) and not fits(pol, 95, 32)        # 2 compacted blocks end before block (95-32)//32=1


def test_observation_window_defaults_to_the_recent_window_through_the_config():
    from moe_lora_rl.rl import config
    from moe_lora_rl.rollout.kv_compression import policy

    assert EvictPolicy(budget=60, recent=16).window == 16 and EvictPolicy(budget=60, recent=16, window=4).window == 4
    cfg = config.load(["rollout.kv_compression=snapkv", "rollout.kv_budget=64", "rollout.kv_evict.recent=24"])
    assert policy(cfg.rollout.kv_budget, cfg.rollout.evict()).window == 24


def _naive_scores(q, q_pos, keys, key_pos, scale):
    w, heads, d = q.shape
    kvh, n, _ = keys.shape
    g = heads // kvh
    out = torch.zeros(kvh, n, dtype=torch.float64)
    for h in range(heads):
        kh = h // g
        for i in range(w):
            vis = [j for j in range(n) if key_pos[kh, j] <= q_pos[i]]
            logits = [float(q[i, h].double() @ keys[kh, j].double()) * scale for j in vis]
            m = max(logits)
            z = sum(math.exp(x - m) for x in logits)
            for j, x in zip(vis, logits):
                out[kh, j] += math.exp(x - m) / z / g
    return out


def test_scores_equal_an_explicit_loop():
    torch.manual_seed(0)
    kvh, heads, d, n, w = 2, 4, 8, 30, 5
    key_pos = torch.stack([torch.sort(torch.randperm(60)[:n]).values for _ in range(kvh)])
    key_pos[:, -w:] = torch.arange(55, 60)                   # the observing queries' own tokens are held
    q_pos = torch.arange(55, 60)
    q, keys = torch.randn(w, heads, d), torch.randn(kvh, n, d)
    got = scores(q, q_pos, keys, key_pos, 0.35)
    want = _naive_scores(q, q_pos, keys, key_pos, 0.35)
    assert torch.allclose(got.double(), want, atol=1e-6), (got - want).abs().max()
    assert torch.allclose(got.sum(1).double(), torch.full((kvh,), float(w), dtype=torch.float64), atol=1e-5)
    # the control: a query that may see later tokens gives other scores
    bad = scores(q, q_pos + 5, keys, key_pos, 0.35)
    assert (bad - got).abs().max() > 1e-3


def test_select_keeps_sinks_and_the_top_pooled_candidates():
    torch.manual_seed(1)
    pol = EvictPolicy(budget=20, sinks=2, recent=6, window=4, pool=3)
    seq_len, kvh = 40, 2
    key_pos = torch.arange(seq_len).expand(kvh, -1)
    score = torch.rand(kvh, seq_len)
    kept = select(score, key_pos, pol, seq_len)
    assert kept.shape == (kvh, pol.compacted)
    for h in range(kvh):
        cand = list(range(pol.sinks, seq_len - pol.recent))
        c = score[h, cand]
        pooled = [float(c[max(0, i - 1): i + 2].max()) for i in range(len(cand))]
        want = sorted(cand[i] for i in sorted(range(len(cand)), key=lambda i: -pooled[i])[:pol.chosen])
        assert kept[h].tolist() == [0, 1] + want
    # a token every query attends to is kept; with its score zeroed it is not (pool 1: no neighbours)
    pol1 = EvictPolicy(budget=20, sinks=2, recent=6, window=4, pool=1)
    score = torch.rand(kvh, seq_len) * 0.01
    score[:, 17] = 5.0
    assert 17 in select(score, key_pos, pol1, seq_len)[0].tolist()
    score[:, 17] = 0.0
    assert 17 not in select(score, key_pos, pol1, seq_len)[0].tolist()


def test_select_per_head_positions_after_a_compaction():
    """After a compression each head holds its own tokens (the compacted slots, then the open region): candidates
    and their scores are found per head."""
    pol = EvictPolicy(budget=12, sinks=1, recent=4, window=2, pool=1)
    kept0 = torch.tensor([[0, 3, 5, 6, 9, 10, 11, 12], [0, 1, 2, 4, 7, 8, 12, 13]])
    open_pos = torch.arange(16, 24).expand(2, -1)
    key_pos = torch.cat([kept0, open_pos], 1)
    score = torch.arange(key_pos.shape[1], dtype=torch.float32).expand(2, -1).clone()
    kept = select(score, key_pos, pol, 24)
    assert kept[0].tolist() == [0, 10, 11, 12, 16, 17, 18, 19]
    assert kept[1].tolist() == [0, 8, 12, 13, 16, 17, 18, 19]
