"""Routes container, alignment, metrics and the replay queue (pure / single process)."""
import numpy as np
import pytest
import torch

from moe_lora_rl.router_replay.align import align_microbatch, spread_pad
from moe_lora_rl.mismatch import k3_kl, ratio_below, ratio_exceeds
from moe_lora_rl.router_replay.disagreement import router_disagreement
from moe_lora_rl.router_replay.replayer import Mode, RouteReplay
from moe_lora_rl.router_replay.routes import RoutesBatch


def _routes(lengths, layers=(1, 2, 3), k=2, e=16, seed=0):
    rng = np.random.default_rng(seed)
    return RoutesBatch([rng.integers(0, e, (n, len(layers), k)) for n in lengths], tuple(layers), e, k)


def test_compact_dtype_and_bytes():
    r = _routes([5, 3])
    assert r.samples[0].dtype == np.uint8 and r.bytes_per_token == 3 * 2          # = moe_layers * top_k
    big = RoutesBatch([np.full((2, 1, 8), 383)], (1,), 384, 8)
    assert big.samples[0].dtype == np.uint16 and big.bytes_per_token == 16


def test_validation_names_sample_layer_sizes():
    with pytest.raises(ValueError, match=r"sample 1 have shape \(4, 2, 2\); expected \[tokens, 3 MoE layers, top-k 2\]"):
        RoutesBatch([np.zeros((4, 3, 2)), np.zeros((4, 2, 2))], (1, 2, 3), 16, 2)
    bad = np.zeros((4, 3, 2))
    bad[2, 1, 0] = 16
    with pytest.raises(ValueError, match=r"sample 0: expert id 16 at token 2, layer 2 is out of range 0..15"):
        RoutesBatch([bad], (1, 2, 3), 16, 2)
    with pytest.raises(ValueError, match="sample 1: routes cover 3 tokens, the sample has 4"):
        _routes([5, 3]).check_tokens([5, 4])
    with pytest.raises(ValueError, match="routes for 2 samples, batch has 3"):
        _routes([5, 3]).check_tokens([5, 3, 1])


def test_field_roundtrip():
    r = _routes([5, 3, 7])
    back = RoutesBatch.from_field(r.to_field(), 16)
    assert back.layer_ids == r.layer_ids and all(np.array_equal(a, b) for a, b in zip(r.samples, back.samples))


def test_spread_pad_balances_experts():
    pad = spread_pad(100, 4, 16)
    assert all(len(set(row)) == 4 for row in pad.tolist())
    counts = np.bincount(pad.reshape(-1), minlength=16)
    assert counts.max() - counts.min() <= 1                    # never all padding on experts 0..k-1


def test_align_padded_sequence_parallel_and_stage_layers():
    r = _routes([5, 3], layers=(1, 2, 3))
    out = align_microbatch(r, [0, 1], padded_len=6, stage_layers=[2, 3], tp_rank=1, tp_size=2,
                           sequence_parallel=True)
    assert len(out) == 2 and out[0].shape == (3 * 2, 2)         # seq 6 / tp 2 = 3 positions x batch 2
    # s-major: position 3 of sample 0 then of sample 1 (padding), ...
    assert out[0][0].tolist() == r.samples[0][3, 1].tolist()
    assert out[0][2].tolist() == r.samples[0][4, 1].tolist()
    full = align_microbatch(r, [0, 1], padded_len=6, stage_layers=[2, 3])[0].reshape(6, 2, 2)
    assert torch.equal(full[3:].reshape(-1, 2), out[0])
    assert full[3:, 1].tolist() == spread_pad(3, 2, 16, start=6).tolist()   # sample 1's padding


def test_align_packed_and_errors():
    r = _routes([5, 3])
    out = align_microbatch(r, [1, 0], padded_len=None, stage_layers=[1])
    assert torch.equal(out[0], torch.from_numpy(np.concatenate([r.samples[1][:, 0], r.samples[0][:, 0]])).long())
    with pytest.raises(ValueError, match=r"routes have no MoE layers \[0\]"):
        align_microbatch(r, [0], padded_len=None, stage_layers=[0, 1])          # a dense layer has no routes
    with pytest.raises(ValueError, match="routes missing for sample 2"):
        align_microbatch(r, [2], padded_len=None, stage_layers=[1])
    with pytest.raises(ValueError, match="sample 0: 5 routed tokens > padded length 4"):
        align_microbatch(r, [0], padded_len=4, stage_layers=[1])


def test_metrics_hand_computed():
    a = torch.tensor([[0, 1], [2, 3]])
    b = torch.tensor([[1, 0], [2, 5]])
    assert router_disagreement(a, b) == pytest.approx(0.25)
    lt, li = torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0])
    r = np.exp(-1.0)
    assert k3_kl(lt, li) == pytest.approx(((r - 1) - (-1.0)) / 2)
    assert ratio_exceeds(torch.tensor([0.0, 1.0, -2.0]), torch.zeros(3), 2.0) == pytest.approx(2 / 3)
    # the lower tail only: exp(-2) and exp(-10) are below 0.5, exp(-10) alone below 1e-4; exp(1) is not
    low = torch.tensor([0.0, 1.0, -2.0, -10.0])
    assert ratio_below(low, torch.zeros(4), 0.5) == pytest.approx(2 / 4)
    assert ratio_below(low, torch.zeros(4), 1e-4, torch.tensor([1.0, 1.0, 1.0, 0.0])) == 0.0
    assert ratio_below(low, torch.zeros(4), 1e-4) == pytest.approx(1 / 4)
    with pytest.raises(ValueError, match="cannot be compared"):
        router_disagreement(a, b[:1])


def _default_topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, topk, dim=1)


def test_replay_queue_consumed_once_and_checked():
    rp = RouteReplay(layer=3, num_experts=8, topk=2, recompute=False)
    rp.mode = Mode.REPLAY
    scores = torch.randn(4, 8)
    rp.queue.append(torch.tensor([[7, 1]] * 4))
    probs, idx = rp.get_replay_topk(scores, 2, default_compute_topk=_default_topk)
    assert idx.tolist() == [[7, 1]] * 4 and torch.equal(probs, scores.gather(1, idx))
    assert rp.recorded == []                                   # nothing kept in replay mode unless asked
    with pytest.raises(ValueError, match="layer 3: no recorded route left for a forward of 4 tokens"):
        rp.get_replay_topk(scores, 2, default_compute_topk=_default_topk)
    rp.queue.append(torch.zeros(5, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"layer 3: routes of shape \(5, 2\) for a router input of 4 tokens"):
        rp.get_replay_topk(scores, 2, default_compute_topk=_default_topk)


def test_replay_with_activation_recompute():
    rp = RouteReplay(layer=1, num_experts=8, topk=2, recompute=True)
    rp.mode, rp.backward = Mode.REPLAY, True                   # a training pass (RouterReplayer.set_mode(backward=))
    target = torch.tensor([[5, 6], [0, 7]])
    rp.queue.append(target)
    x = torch.randn(2, 8, requires_grad=True)

    def f(s):
        probs, idx = rp.get_replay_topk(s * 2, 2, default_compute_topk=_default_topk)
        assert torch.equal(idx, target)
        return probs.sum()
    y = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True)
    assert len(rp.recompute_queue) == 1
    y.backward()                                               # recompute pops the same routes
    assert not rp.queue and not rp.recompute_queue and rp.consumed == [1, 1]
    assert x.grad is not None and x.grad[0, 5] == 2 and x.grad[0, 0] == 0   # gradient flows at replayed experts


def test_recompute_copy_only_for_checkpointed_forwards_of_a_training_pass():
    """A layer outside the checkpoint (recompute_method block) and a forward-only pass through a checkpoint keep no
    copy: check_consumed would otherwise fail on routes no backward ever asks for."""
    rp = RouteReplay(layer=1, num_experts=8, topk=2, recompute=True)
    rp.mode, rp.backward = Mode.REPLAY, True
    x = torch.randn(2, 8, requires_grad=True)
    rp.queue.append(torch.tensor([[5, 6], [0, 7]]))
    rp.get_replay_topk(x, 2, default_compute_topk=_default_topk)[0].sum().backward()     # not checkpointed
    assert not rp.recompute_queue and rp.consumed == [1, 0]
    rp.backward = False                                        # forward only (e.g. megatron's selective 'moe' in eval)
    rp.queue.append(torch.tensor([[5, 6], [0, 7]]))
    with torch.no_grad():
        torch.utils.checkpoint.checkpoint(lambda s: rp.get_replay_topk(s, 2, default_compute_topk=_default_topk)[0],
                                          x, use_reentrant=True)
    assert not rp.queue and not rp.recompute_queue and rp.consumed == [2, 0]


def test_r2_record_then_replay_in_megatron(qwen):
    """R2: routes recorded in one pass replay bit-exactly in the next; gradients still reach the router; a
    perturbed router does not change the replayed routes."""
    from moe_lora_rl.megatron.forward import forward_logits
    from moe_lora_rl.router_replay.replayer import RouterReplayer

    m = qwen()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    rr = RouterReplayer(m)
    assert rr.layer_ids == [0, 1]
    rr.set_mode("record")
    ref = forward_logits(m, tokens, 512)
    recorded = [r[0] for r in rr.pop_recorded()]
    with torch.no_grad():
        for layer in m.decoder.layers:
            layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight))   # the router now disagrees
    rr.set_mode("disabled")
    moved = forward_logits(m, tokens, 512)
    rr.set_mode("replay")
    rr.queue_microbatch(recorded)
    replayed = forward_logits(m, tokens, 512)
    rr.check_consumed()
    assert rr.pop_recorded() == [[], []]                         # replay keeps nothing unless asked
    rr.set_mode("replay", keep_replayed=True)
    rr.queue_microbatch(recorded)
    forward_logits(m, tokens, 512)
    again = [r[0] for r in rr.pop_recorded()]
    assert all(torch.equal(a, b) for a, b in zip(again, recorded))
    assert (moved - ref).abs().max() > 1e-3                      # the perturbation matters without replay
    assert (replayed - moved).abs().max() > 0                    # replay changes the computation ...
    with pytest.raises(ValueError, match=r"routes left unconsumed per layer .*\{0: \(1, 0\), 1: \(1, 0\)\}"):
        rr.queue_microbatch(recorded)
        rr.check_consumed()
    rr.pop_recorded()
    for r in rr.replays:
        r.queue.clear()
    with pytest.raises(ValueError, match=r"layer 1: expert id out of range 0..7"):
        rr.queue_microbatch([recorded[0], recorded[1] + 8])
    rr.detach()
    assert all(layer.mlp.router.router_replay is None for layer in m.decoder.layers)


def test_replay_keeps_routes_only_when_asked():
    rp = RouteReplay(layer=0, num_experts=8, topk=2, recompute=False)
    rp.mode = Mode.REPLAY
    for keep, kept in ((False, 0), (True, 3)):
        rp.keep_replayed = keep
        for _ in range(3):
            rp.queue.append(torch.tensor([[0, 1]] * 4))
            rp.get_replay_topk(torch.randn(4, 8), 2, default_compute_topk=_default_topk)
        assert len(rp.recorded) == kept


def test_replay_measures_disagreement_on_real_tokens_only():
    from moe_lora_rl.router_replay.replayer import RouterReplayer

    rp = RouteReplay(layer=2, num_experts=8, topk=2, recompute=False)
    rp.mode = Mode.REPLAY
    rr = RouterReplayer.__new__(RouterReplayer)          # the queueing logic only, without a model
    rr.replays, rr.routers = [rp], []
    scores = torch.tensor([[9., 8, 0, 0, 0, 0, 0, 0]] * 3)                         # own top-2: {0, 1}
    routes = torch.tensor([[1, 0], [0, 5], [6, 7]])                                # 0, 1 and 2 decisions differ
    rr.queue_microbatch([routes], real=torch.tensor([True, True, False]))          # the last token is padding
    probs, idx = rp.get_replay_topk(scores, 2, default_compute_topk=_default_topk)
    assert torch.equal(idx, routes) and torch.equal(probs, scores.gather(1, routes))
    assert rr.pop_disagreement() == {2: (1, 4)} and rr.pop_disagreement() == {2: (0, 0)}
    rr.queue_microbatch([routes])                                                  # not measured
    rp.get_replay_topk(scores, 2, default_compute_topk=_default_topk)
    assert rr.pop_disagreement() == {2: (0, 0)}
    with pytest.raises(ValueError, match=r"layer 2: real-token mask of shape \(2,\) for routes of 3 tokens"):
        rr.queue_microbatch([routes], real=torch.tensor([True, False]))
    assert not rp.queue                                                            # nothing queued on error
    rr.queue_microbatch([routes], real=torch.ones(3, dtype=torch.bool))
    rr.clear()
    assert not rp.queue and not rp.measure_queue and rp.mode is Mode.DISABLED


def test_real_token_mask_and_unalign_invert_align():
    from moe_lora_rl.router_replay.align import real_token_mask, unalign_microbatch

    r = _routes([5, 3], layers=(1, 2))
    for tp_rank in (0, 1):
        sp = dict(tp_rank=tp_rank, tp_size=2, sequence_parallel=True)
        out = align_microbatch(r, [0, 1], padded_len=6, stage_layers=[2], **sp)[0]
        real = real_token_mask([5, 3], padded_len=6, **sp)
        lo, grid = unalign_microbatch(out, 2, padded_len=6, **sp)
        assert lo == 3 * tp_rank and grid.shape == (3, 2, 2)
        for b, n in enumerate((5, 3)):
            for pos in range(3):
                p = lo + pos
                assert bool(real.view(3, 2)[pos, b]) == (p < n)
                if p < n:
                    assert grid[pos, b].tolist() == r.samples[b][p, 1].tolist()
    with pytest.raises(ValueError, match="router output of 5 tokens for 2 samples x 6 positions"):
        unalign_microbatch(torch.zeros(5, 2), 2, padded_len=6)
    with pytest.raises(ValueError, match="sequence length 5 does not split over 2 sequence-parallel ranks"):
        real_token_mask([5], padded_len=5, tp_rank=0, tp_size=2, sequence_parallel=True)


def test_token_flags_or_over_a_stages_layers():
    from moe_lora_rl.router_replay.replayer import RouterReplayer

    a, b = (RouteReplay(layer=l, num_experts=8, topk=2, recompute=False) for l in (1, 2))
    rr = RouterReplayer.__new__(RouterReplayer)
    rr.replays, rr.routers = [a, b], []
    rr.set_mode(Mode.REPLAY)
    scores = torch.tensor([[9., 8, 0, 0, 0, 0, 0, 0]] * 4)                         # own top-2: {0, 1}
    ok, bad = torch.tensor([[0, 1]]), torch.tensor([[0, 7]])
    # token 0: differs in layer 1 only; token 1: in layer 2 only; token 2: nowhere; token 3: padding (differs)
    rr.queue_microbatch([torch.cat([bad, ok, ok, bad]), torch.cat([ok, bad, ok, bad])],
                        real=torch.tensor([True, True, True, False]))
    for r in (a, b):
        r.get_replay_topk(scores, 2, default_compute_topk=_default_topk)
    assert rr.pop_token_flags().tolist() == [True, True, False]
    assert rr.pop_token_flags().tolist() == []                                      # popped
    assert rr.pop_disagreement() == {1: (1, 6), 2: (1, 6)}
    empty = RouterReplayer.__new__(RouterReplayer)
    empty.replays, empty.routers = [], []
    assert empty.pop_token_flags() is None                                          # a stage without MoE layers


def test_routes_disagreement_decisions_and_tokens():
    from moe_lora_rl.router_replay.disagreement import routes_disagreement

    g = torch.Generator().manual_seed(0)
    samples = [torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(n * 2)]).reshape(n, 2, 4).numpy()
               for n in (5, 7)]
    rollout = RoutesBatch(samples, layer_ids=(1, 3), num_experts=16, topk=4)
    same = RoutesBatch([s[:, :, ::-1].copy() for s in samples], (1, 3), 16, 4)     # order within top-k ignored
    assert routes_disagreement(same, rollout) == {"decisions": 0.0, "tokens": 0.0}
    changed = [s.copy() for s in samples]
    for s, (t, l, k) in zip(changed, ((0, 0, 1), (6, 1, 3))):                       # one new expert in each sample
        s[t, l, k] = next(e for e in range(16) if e not in s[t, l])
    changed[1][2, 0, 0] = next(e for e in range(16) if e not in changed[1][2, 0])  # and one more token
    got = routes_disagreement(RoutesBatch(changed, (1, 3), 16, 4), rollout)
    assert got == {"decisions": 3 / (12 * 2 * 4), "tokens": 3 / 12}
    with pytest.raises(ValueError, match=r"layers \[1, 3\] top-4 for 2 samples cannot be compared with layers"):
        routes_disagreement(rollout, RoutesBatch(samples, (1, 2), 16, 4))
    with pytest.raises(ValueError, match=r"sample 0: routes of shapes \(5, 2, 4\) and \(4, 2, 4\)"):
        routes_disagreement(rollout, RoutesBatch([samples[0][:4], samples[1]], (1, 3), 16, 4))
