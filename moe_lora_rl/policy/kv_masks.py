"""KV replay (pure): the tokens an evicting sampler held for each query, as the attention masks the trainer replays.

    record = {"recent": 32, "events": [[seq_len, kept], ...]}    # one sample's, from the engine (vllm/kv_evict.py)
    visible(n, record, layers, kv_heads)      -> per layer bool [kv_heads, n, n]: query t sees key j
    batch_masks(records, width, ...)          -> per layer bool [b, heads on this TP rank, width, width], True = masked

An event is one compression: after the step that filled positions < seq_len, each layer's KV head kept `kept[layer]
[head]` (the sinks and the tokens chosen by score) and the tokens from seq_len - recent on; every later query sees
those and the tokens written after them. Before the first compression a query sees every earlier token (causal).
With these masks the trainer's forward is the sampler's: the policy it trains is the one that sampled (as router
replay does for routing), and the consistency ratio is 1 up to numerics.
"""
from __future__ import annotations

import torch


def check_record(record, n: int, layers: int, kv_heads: int, row: int = 0) -> None:
    """ValueError naming the row and the bad value: the record's shape must match the model and the sequence."""
    if not isinstance(record, dict) or set(record) != {"recent", "events"}:
        raise ValueError(f"row {row}: kv replay record must be {{'recent', 'events'}}, got {record!r:.80}")
    recent, last = record["recent"], 0
    if not isinstance(recent, int) or recent < 1:
        raise ValueError(f"row {row}: kv replay recent={recent!r} must be an int >= 1")
    for e, ev in enumerate(record["events"]):
        s, kept = ev
        if not isinstance(s, int) or not recent <= s or s <= last:
            raise ValueError(f"row {row}: kv replay event {e} at seq_len={s!r}: must be >= recent={recent} and "
                             f"after the previous event ({last})")
        if len(kept) != layers or any(len(k) != kv_heads for k in kept):
            raise ValueError(f"row {row}: kv replay event {e} has {len(kept)} layers x "
                             f"{sorted({len(k) for k in kept})} KV heads; the model has {layers} x {kv_heads}")
        bad = [p for k in kept for h in k for p in h if not (isinstance(p, int) and 0 <= p < s - recent)]
        if bad:
            raise ValueError(f"row {row}: kv replay event {e} keeps position {bad[0]!r}, outside 0..{s - recent - 1} "
                             f"(held before the recent window at seq_len={s})")
        last = s
    if last > n:
        raise ValueError(f"row {row}: kv replay event at seq_len={last} is beyond the row's {n} tokens")


def visible(n: int, record: dict | None, layers: int, kv_heads: int, swap=None) -> list[torch.Tensor]:
    """[layers] bool [kv_heads, n, n]: query t sees key j. record None: causal. swap (event, layer, head, old, new):
    one kept position replaced (the checks' control)."""
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    masks = [causal.expand(kv_heads, n, n).clone() for _ in range(layers)]
    if record is None:
        return masks
    events, recent = record["events"], record["recent"]
    bounds = [s for s, _ in events] + [n]
    for e, (s, kept) in enumerate(events):
        lo, hi = s, bounds[e + 1]
        if lo >= n:
            break
        for li in range(layers):
            for h in range(kv_heads):
                keep = list(kept[li][h])
                if swap is not None and tuple(swap[:3]) == (e, li, h):
                    keep[keep.index(swap[3])] = swap[4]
                m = torch.zeros(hi - lo, n, dtype=torch.bool)
                m[:, keep] = True
                m[:, s - recent:] = True
                masks[li][h, lo:hi] = m & causal[lo:hi]
    return masks


def batch_masks(records: list, width: int, layers: int, heads: int, kv_heads: int, tp_rank: int = 0,
                tp_size: int = 1) -> dict[int, torch.Tensor]:
    """{layer: bool [b, heads // tp_size, width, width], True = masked} for rows of `width` tokens (right-padded):
    each query head takes its KV head's mask (grouped-query attention: head h reads KV head h // (heads /
    kv_heads)), the heads of this tensor-parallel rank only."""
    if heads % kv_heads or heads % tp_size or kv_heads % tp_size:
        raise ValueError(f"kv replay: {heads} heads, {kv_heads} KV heads do not split over tensor parallel "
                         f"size {tp_size}")
    local = heads // tp_size
    kv_of = torch.arange(tp_rank * local, (tp_rank + 1) * local) // (heads // kv_heads)
    rows = [visible(width, r, layers, kv_heads) for r in records]
    return {li: ~torch.stack([m[li][kv_of] for m in rows]) for li in range(layers)}
