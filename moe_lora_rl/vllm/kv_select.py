"""Importance-based KV eviction (SnapKV-style), the pure part: which tokens a sequence keeps, decided from the
attention its most recent queries pay to the tokens it holds. kv_evict.py moves the tensors; the HF reference
(tests/kit/sparse_evict.py) rebuilds the same masks from the engine's log.

    pol = EvictPolicy(budget=96, sinks=4, recent=32, window=32, interval=16, pool=7)
    s = scores(q_obs, q_pos, keys, key_pos, scale)              # [kv_heads, n_live]: what the window attends to
    kept = select(s, key_pos, pol, seq_len)                     # [kv_heads, budget - recent] positions, sorted

A sequence keeps at most `budget` tokens of KV, counted after each compression: the first `sinks` positions, the
last `recent` positions, and, per KV head, the `budget - sinks - recent` other tokens with the highest pooled
score. A compression runs at the end of an engine step once a sequence holds more than `budget` tokens, and again
every `interval` steps while it does; between two, the sequence grows by up to `interval` tokens.

The score of a held token for one KV head: the softmax attention of each of the last `window` queries of the
sequence (causal: a query does not see later tokens) over every token held, summed over those queries and averaged
over the query heads of the group, then max-pooled over `pool` neighbours in position order (SnapKV's clustering:
a kept token brings the tokens around it). Sinks and the recent tokens are kept whatever their score and are not
candidates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EvictPolicy:
    budget: int                 # tokens held after a compression, sinks and recent included
    sinks: int = 4              # first positions, always kept
    recent: int = 32            # last positions, always kept (the sequence's open region)
    window: int | None = None   # observation window: the last queries whose attention scores the tokens (None: the
    #                             recent window, as SnapKV observes with the tokens it keeps last)
    interval: int = 16          # engine steps between two compressions of a sequence
    pool: int = 7               # max-pool kernel over the scores, in position order (odd; 1: none)

    def __post_init__(self):
        if self.window is None:
            object.__setattr__(self, "window", self.recent)
        for name in ("budget", "sinks", "recent", "window", "interval", "pool"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"kv eviction {name}={v!r} is not an integer")
        if self.interval < 1:
            raise ValueError(f"kv eviction interval={self.interval} is below 1 (compress every N >= 1 decode steps)")
        if self.sinks < 0 or self.recent < 1 or self.window < 1:
            raise ValueError(f"kv eviction sinks={self.sinks}, recent={self.recent}, window={self.window}: sinks "
                             f"must be >= 0, the recent window and the observation window >= 1")
        if self.budget <= self.sinks + self.recent:
            raise ValueError(f"kv_budget={self.budget} is not above the sinks plus the recent window "
                             f"({self.sinks} + {self.recent}): nothing would be chosen by importance")
        if self.window > self.budget:
            raise ValueError(f"kv eviction window={self.window} (observation window) is larger than the budget "
                             f"{self.budget}")
        if self.window > self.recent:
            raise ValueError(f"kv eviction window={self.window} is larger than the recent window {self.recent}: "
                             f"the observing queries must be tokens the sequence still holds")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"kv eviction pool={self.pool} must be an odd kernel >= 1")

    @property
    def chosen(self) -> int:
        """Tokens chosen by score at each compression."""
        return self.budget - self.sinks - self.recent

    @property
    def compacted(self) -> int:
        """Slots of the compacted region: the sinks and the chosen tokens, each KV head its own."""
        return self.budget - self.recent


def scores(q_obs: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor,
           scale: float) -> torch.Tensor:
    """[kv_heads, n] score of each held token. q_obs [w, heads, d] (RoPE applied), q_pos [w]; keys
    [kv_heads, n, d] as cached, key_pos [kv_heads, n] (each head holds its own tokens). Computed in fp32."""
    w, heads, d = q_obs.shape
    kvh = keys.shape[0]
    group = heads // kvh
    q = q_obs.float().reshape(w, kvh, group, d).permute(1, 2, 0, 3)            # [kvh, g, w, d]
    logits = torch.einsum("hgwd,hnd->hgwn", q, keys.float()) * scale           # [kvh, g, w, n]
    visible = key_pos[:, None, None, :] <= q_pos[None, None, :, None]          # causal
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, -1).sum(2).mean(1)                            # [kvh, n]


def select(score: torch.Tensor, key_pos: torch.Tensor, pol: EvictPolicy, seq_len: int) -> torch.Tensor:
    """[kv_heads, compacted] positions kept in the compacted region (sorted per head): the sinks, and the `chosen`
    candidates with the highest max-pooled score (pooling makes neighbours tie: the earlier position wins).
    Candidates are the held tokens that are neither sinks nor among the last `recent` positions of a sequence of
    `seq_len` tokens. key_pos must be sorted per head."""
    kvh, n = score.shape
    cand = (key_pos >= pol.sinks) & (key_pos < seq_len - pol.recent)
    n_cand = int(cand[0].sum())
    if bool((cand.sum(1) != n_cand).any()):
        raise AssertionError(f"kv eviction: KV heads hold different candidate counts {cand.sum(1).tolist()}")
    if n_cand < pol.chosen:
        raise AssertionError(f"kv eviction: {n_cand} candidates for {pol.chosen} choices (seq_len {seq_len})")
    c_score = score[cand].reshape(kvh, n_cand)
    c_pos = key_pos[cand].reshape(kvh, n_cand)
    if pol.pool > 1:
        c_score = torch.nn.functional.max_pool1d(c_score[:, None], pol.pool, 1, pol.pool // 2)[:, 0]
    top = torch.sort(c_score, dim=1, descending=True, stable=True).indices[:, :pol.chosen]   # ties: earlier position
    chosen = torch.gather(c_pos, 1, top)
    sinks = torch.arange(min(pol.sinks, seq_len), dtype=key_pos.dtype).expand(kvh, -1)
    return torch.sort(torch.cat([sinks, chosen], 1), 1).values


def compress_due(pol: EvictPolicy, held: int, since: int | None) -> bool:
    """A compression runs when a sequence holds more than the budget and it never ran (since None) or ran
    `interval` or more steps ago."""
    return held > pol.budget and (since is None or since >= pol.interval)


def fits(pol: EvictPolicy, seq_len: int, block_size: int) -> bool:
    """The compacted region (the first blocks of the sequence) ends before the block of the first recent
    position, so compaction never overwrites a token still held by position. When it does not, the compression
    waits for the sequence to grow."""
    return -(-pol.compacted // block_size) <= (seq_len - pol.recent) // block_size


def restart_events(events: list, seq_len: int, recent: int, layers: int, kv_heads: int) -> list:
    """A sequence's compression log after vLLM preempted it and recomputed its `seq_len` tokens densely: the tokens
    it sampled before kept their compressions; from the prefill's last query (position seq_len - 1, which samples
    the next token) every earlier token is held again, written as a compression that keeps them all. A compression
    at that same position had no query under it and is dropped; a log without any compression stays empty."""
    s = seq_len - 1
    out = [e for e in events if e[0] < s]
    if not out:
        return []
    every = list(range(s - recent))
    return [*out, (s, [[every] * kv_heads for _ in range(layers)])]
