"""Shard assembly (HF -> Megatron layout) against hand-built expectations (names: test_naming.py)."""
import torch

from moe_lora_rl.megatron.hf_load import ShardSpec, assemble
from moe_lora_rl.models.arch import arch_from_hf_config
from moe_lora_rl.models.tiny import build_hf_config

ARCH = arch_from_hf_config(build_hf_config("qwen3_moe", "tiny"))   # 4 heads, 2 kv groups, head_dim 32


def test_qkv_interleaves_query_groups_then_splits():
    h, hd = 8, ARCH.head_dim
    q = torch.arange(4 * hd * h, dtype=torch.float32).reshape(4 * hd, h)
    k = -torch.arange(2 * hd * h, dtype=torch.float32).reshape(2 * hd, h) - 1
    v = 1000 + torch.arange(2 * hd * h, dtype=torch.float32).reshape(2 * hd, h)
    full = assemble("qkv", [q, k, v], ARCH, ShardSpec(0, 1), 0)
    # group g: q heads 2g, 2g+1, then k_g, then v_g
    expect = torch.cat([q[0:2 * hd], k[0:hd], v[0:hd], q[2 * hd:4 * hd], k[hd:2 * hd], v[hd:2 * hd]])
    assert torch.equal(full, expect)
    r1 = assemble("qkv", [q, k, v], ARCH, ShardSpec(1, 2), 0)
    assert torch.equal(r1, expect[4 * hd:])
    bias = assemble("qkv", [q[:, 0], k[:, 0], v[:, 0]], ARCH, ShardSpec(0, 1), 0)
    assert torch.equal(bias, expect[:, 0])


def test_glu_row_vocab():
    gate, up = torch.arange(8.).reshape(4, 2), 100 + torch.arange(8.).reshape(4, 2)
    assert torch.equal(assemble("glu", [gate, up], ARCH, ShardSpec(1, 2), 0), torch.cat([gate[2:], up[2:]]))
    down = torch.arange(8.).reshape(2, 4)
    assert torch.equal(assemble("row", [down], ARCH, ShardSpec(1, 2), 0), down[:, 2:])
    emb = torch.ones(5, 3)
    shard = assemble("vocab", [emb], ARCH, ShardSpec(1, 2), 6)       # padded 5 -> 6 rows
    assert shard.shape == (3, 3) and shard[-1].abs().sum() == 0 and shard[:2].sum() == 6
