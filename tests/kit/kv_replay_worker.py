"""torchrun worker (2 ranks): KV replay in the trainer (policy/kv_masks.py through megatron/layer_masks.py) against
HF transformers given the same per-layer, per-KV-head masks (tests/kit/sparse_evict.hf_logprobs), at several layouts.

The batch: 4 rows of random tokens (27-48 tokens), each with a seeded eviction record (compressions every 8
positions from 16 on, 2 sinks and 4 chosen positions per layer and KV head, the last 6 tokens kept), adapters at
their initialisation (B = 0: the base's logprobs). Per layout: the Policy's logprobs with the records vs HF with
their masks; controls: the Policy without records (dense attention) and HF with one kept position of one row
swapped for an evicted one. Rank 0 writes the numbers as JSON.
"""
from __future__ import annotations

import dataclasses
import random

import torch

from moe_lora_rl.algos import PolicyLossSettings
from moe_lora_rl.lora import LoRAConfig
from moe_lora_rl.policy.core import Policy, PolicyBatch
from moe_lora_rl.policy.kv_masks import visible
from moe_lora_rl.checks.torchrun import each_layout, finish_worker, worker_args

LENGTHS = [40, 33, 48, 27]
RECENT, SINKS, CHOSEN = 6, 2, 4


def record(n: int, layers: int, kv_heads: int, rng: random.Random) -> dict:
    events = []
    for s in range(16, n, 8):
        kept = [[sorted([*range(SINKS), *rng.sample(range(SINKS, s - RECENT), CHOSEN)]) for _ in range(kv_heads)]
                for _ in range(layers)]
        events.append([s, kept])
    return {"recent": RECENT, "events": events}


def make_batch(vocab: int, layers: int, kv_heads: int) -> PolicyBatch:
    g, rng = torch.Generator().manual_seed(4321), random.Random(7)
    n, s = len(LENGTHS), max(LENGTHS)
    tokens = torch.zeros(n, s, dtype=torch.long)
    for i, k in enumerate(LENGTHS):
        tokens[i, :k] = torch.randint(3, vocab, (k,), generator=g)
    t = torch.arange(s - 1)[None, :]
    mask = t < torch.tensor(LENGTHS)[:, None] - 1
    return PolicyBatch(tokens, list(LENGTHS), mask, mask.float(), None, None, list(range(n)),
                       kv_kept=[record(k, layers, kv_heads, rng) for k in LENGTHS])


def swap_of(rec: dict) -> tuple:
    """(event, layer, head, a chosen kept position, an evicted one) of the record's last compression."""
    e = len(rec["events"]) - 1
    s, kept = rec["events"][e]
    keep = kept[1][1]
    return (e, 1, 1, keep[-1], next(p for p in range(SINKS, s - RECENT) if p not in keep))


def main(argv=None) -> None:
    import torch.distributed as dist

    a = worker_args(argv, add=lambda ap: (ap.add_argument("--model", required=True),
                                          ap.add_argument("--layouts", required=True)))
    res: dict = {"layouts": {}}
    hf_rows = None
    for key, layout in each_layout(a.layouts, a.rc):
        pol = Policy(a.model, layout, a.rc, LoRAConfig(rank=4, alpha=8.0), lr=0.0, weight_decay=0.0, grad_clip=1.0,
                     loss=PolicyLossSettings(), micro_batch_size=1)
        arch = pol.arch
        batch = make_batch(arch.vocab_size, arch.num_layers, arch.num_kv_heads)
        replayed = pol.logprobs(batch, replay="off").logprobs
        dense = pol.logprobs(dataclasses.replace(batch, kv_kept=None), replay="off").logprobs
        if dist.get_rank() == 0:
            if hf_rows is None:
                hf_rows = reference(a.model, batch, arch)
            same = dense_diff = 0.0
            for i, k in enumerate(LENGTHS):
                mine, theirs = replayed[i, :k - 1], hf_rows["same"][i]
                same = max(same, float((mine - theirs).abs().max()))
                dense_diff = max(dense_diff, float((dense[i, :k - 1] - theirs).abs().max()))
            swapped = float((replayed[0, :LENGTHS[0] - 1] - hf_rows["swapped"]).abs().max())
            res["layouts"][key] = {"same": same, "dense": dense_diff, "swapped": swapped}
        del pol
        dist.barrier()
    res["events_per_row"] = [len(r["events"]) for r in batch.kv_kept]
    finish_worker(res, a.result)


def reference(model: str, batch: PolicyBatch, arch) -> dict:
    """HF's logprobs of each row with its record's masks, and of row 0 with one kept position swapped."""
    from moe_lora_rl.checks.hf import hf_model
    from .sparse_evict import hf_logprobs

    hf = hf_model(model)
    rows = []
    for i, k in enumerate(LENGTHS):
        masks = visible(k, batch.kv_kept[i], arch.num_layers, arch.num_kv_heads)
        rows.append(torch.tensor(hf_logprobs(hf, batch.tokens[i, :k].tolist(), 1, masks)))
    rec = batch.kv_kept[0]
    masks = visible(LENGTHS[0], rec, arch.num_layers, arch.num_kv_heads, swap_of(rec))
    return {"same": rows, "swapped": torch.tensor(hf_logprobs(hf, batch.tokens[0, :LENGTHS[0]].tolist(), 1, masks))}


if __name__ == "__main__":
    main()
