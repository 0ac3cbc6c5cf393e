"""transfer/base_buckets.py: the bucket plan covers every kept byte once, within the bucket size and alignment, cuts
oversized tensors into whole-element pieces, sends each expert from its EP rank and interleaves the senders;
check_covers catches a plan that drops or repeats a piece (control)."""
import dataclasses

import pytest
import torch

from moe_lora_rl.transfer.base_buckets import (ALIGN, GIB, TensorMeta, bucket_bytes, check_covers, expert_of, owners,
                                             plan)


def metas(experts=4):
    out = [TensorMeta("model.embed_tokens.weight", torch.bfloat16, (1000, 64))]
    for layer in range(2):
        p = f"model.layers.{layer}."
        out += [TensorMeta(p + "self_attn.qkv.weight", torch.float32, (96, 64)),
                TensorMeta(p + "input_layernorm.weight", torch.float32, (64,)),
                TensorMeta(p + "mlp.shared_experts.up_proj.weight", torch.bfloat16, (32, 64))]
        out += [TensorMeta(p + f"mlp.experts.{e}.{w}.weight", torch.bfloat16, (48, 64) if w != "down_proj" else (64, 48))
                for e in range(experts) for w in ("gate_proj", "up_proj", "down_proj")]
    return out


def test_every_byte_once_within_size_and_alignment():
    ms = metas()
    size = 16 * ALIGN                                       # 4 KiB: the embedding (128 KB) is cut into pieces
    buckets = plan(ms, size)
    check_covers(ms, buckets)
    assert all(b.nbytes <= size for b in buckets) and [b.index for b in buckets] == list(range(len(buckets)))
    emb = [p for b in buckets for p in b.pieces if p.name == "model.embed_tokens.weight"]
    assert len(emb) == emb[0].parts == 128000 // size + 1 and all(p.nbytes % 2 == 0 for p in emb)
    assert sum(p.nbytes for p in emb) == 1000 * 64 * 2
    odd = [TensorMeta("x", torch.float32, (3, 341))]          # 4092 bytes: pieces of whole float32 elements
    pieces = [p for b in plan(odd, 2 * ALIGN) for p in b.pieces]
    assert [p.nbytes for p in pieces] == [512] * 7 + [4092 - 7 * 512] and all(p.nbytes % 4 == 0 for p in pieces)


def test_control_a_dropped_or_repeated_piece_is_caught():
    ms = metas()
    buckets = plan(ms, 16 * ALIGN)
    i = next(i for i, b in enumerate(buckets) if len(b.pieces) > 1)
    b = buckets[i]
    short = dataclasses.replace(b, pieces=b.pieces[:-1], nbytes=b.pieces[-2].offset + b.pieces[-2].nbytes)
    dropped = buckets[:i] + [short] + buckets[i + 1:]
    check_covers(ms, buckets)
    with pytest.raises(AssertionError):
        check_covers(ms, dropped)
    with pytest.raises(AssertionError):
        check_covers(ms, buckets + [dataclasses.replace(buckets[0], index=len(buckets))])


def test_experts_from_their_ep_rank_the_rest_balanced_and_senders_interleaved():
    ms = metas(experts=4)
    own = owners(ms, experts=4, ep=2, replica=[0, 1])
    for m in ms:
        e = expert_of(m.name)
        if e is not None:
            assert own[m.name] == e // 2, m.name
    assert expert_of("model.layers.0.mlp.shared_experts.up_proj.weight") is None
    load = {r: sum(m.nbytes for m in ms if own[m.name] == r) for r in (0, 1)}
    assert abs(load[0] - load[1]) <= max(m.nbytes for m in ms), load
    buckets = plan(ms, 64 * ALIGN, own)
    check_covers(ms, buckets)
    assert all(p.name in {m.name for m in ms if own[m.name] == b.sender} for b in buckets for p in b.pieces)
    senders = [b.sender for b in buckets]
    k = min(senders.count(0), senders.count(1))
    assert senders[:2 * k] == [0, 1] * k, senders                 # turns while both have buckets left


def test_receiver_filter_plans_only_what_it_keeps():
    ms = metas(experts=4)
    keep = lambda n: expert_of(n) is None or expert_of(n) in (2, 3)          # noqa: E731 - an engine rank's experts
    buckets = plan(ms, 16 * ALIGN, keep=keep)
    check_covers(ms, buckets, keep=keep)
    assert not any(expert_of(p.name) in (0, 1) for b in buckets for p in b.pieces)


def test_bucket_size_rule_and_refusals():
    assert bucket_bytes(80 * GIB, 1 << 20) == 8 * GIB                      # max(8 GiB, largest) below 0.9 free / 3
    assert bucket_bytes(12 * GIB, 1 << 20) == int(0.9 * 12 * GIB / 3) // ALIGN * ALIGN
    assert bucket_bytes(80 * GIB, 10 * GIB) == 10 * GIB                     # the largest tensor in one bucket
    assert bucket_bytes(80 * GIB, 1 << 20, cap=1000) == 768
    with pytest.raises(ValueError, match="below one aligned unit"):
        bucket_bytes(100, 10)
    with pytest.raises(ValueError, match="bucket size 1000"):
        plan(metas(), 1000)
    with pytest.raises(ValueError, match="listed twice"):
        plan(metas() + metas()[:1], 4096)
    with pytest.raises(ValueError, match="ep=3 does not divide experts=4"):
        owners(metas(), experts=4, ep=3, replica=[0, 1, 2])
    with pytest.raises(ValueError, match="experts.2.gate_proj.weight: expert 2 is not below experts=2"):
        owners(metas(experts=4), experts=2, ep=1, replica=[0])
