"""Alignment of a RoutesBatch to one rank's training layout (pure).

    for each MoE layer of this pipeline stage (by global layer number; dense layers have no routes):
        concatenate the microbatch's samples in token order (packed THD), or pad each to the padded length (BSHD);
        padding tokens get expert ids spread over all experts (never all on experts 0..k-1, which would overload
        one EP rank), then keep this TP rank's sequence-parallel slice.

Megatron's router sees tokens in [seq, batch] order flattened (s-major) and, under sequence parallelism, the
rank's contiguous slice of the sequence dimension.
"""
from __future__ import annotations

import numpy as np
import torch

from .routes import RoutesBatch


def spread_pad(num_tokens: int, topk: int, num_experts: int, start: int = 0) -> np.ndarray:
    """Distinct experts per token, rotating so padding load is even across experts (and EP ranks)."""
    if topk > num_experts:
        raise ValueError(f"top-k {topk} > num_experts {num_experts}")
    t = np.arange(start, start + num_tokens)[:, None]
    return ((t * topk + np.arange(topk)[None, :]) % num_experts).astype(np.int64)


def align_microbatch(routes: RoutesBatch, sample_ids: list[int], *, padded_len: int | None, stage_layers: list[int],
                     tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False) -> list[torch.Tensor]:
    """One [local_tokens, topk] int64 tensor per MoE layer of this stage, in layer order.

    padded_len None: THD packing, samples concatenated [1, sum(len)]; else BSHD [len(sample_ids), padded_len]
    with right padding. stage_layers: global layer numbers of this stage's MoE layers.
    """
    missing = [l for l in stage_layers if l not in routes.layer_ids]
    if missing:
        raise ValueError(f"routes have no MoE layers {missing} (recorded layers: {list(routes.layer_ids)})")
    for s in sample_ids:
        if not 0 <= s < len(routes.samples):
            raise ValueError(f"routes missing for sample {s} (batch has {len(routes.samples)})")
    cols = [routes.layer_ids.index(l) for l in stage_layers]
    k, e = routes.topk, routes.num_experts
    if padded_len is None:                                        # THD: one packed sequence, batch 1
        per_layer = [np.concatenate([routes.samples[s][:, c] for s in sample_ids]).astype(np.int64) for c in cols]
        seq_major = per_layer
    else:
        seq_major = []
        for c in cols:
            grid = np.empty((padded_len, len(sample_ids), k), dtype=np.int64)   # [s, b, k]
            for b, s in enumerate(sample_ids):
                r = routes.samples[s][:, c]
                if r.shape[0] > padded_len:
                    raise ValueError(f"sample {s}: {r.shape[0]} routed tokens > padded length {padded_len}")
                grid[: r.shape[0], b] = r
                grid[r.shape[0]:, b] = spread_pad(padded_len - r.shape[0], k, e, start=b * padded_len)
            seq_major.append(grid)
    out = []
    for g in seq_major:
        lo, hi = sequence_slice(g.shape[0], tp_rank, tp_size, sequence_parallel)
        out.append(torch.from_numpy(np.ascontiguousarray(g[lo:hi]).reshape(-1, k)))
    return out


def sequence_slice(seq_len: int, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False
                   ) -> tuple[int, int]:
    """[lo, hi) of the sequence positions this TP rank's router sees."""
    if not (sequence_parallel and tp_size > 1):
        return 0, seq_len
    if seq_len % tp_size:
        raise ValueError(f"sequence length {seq_len} does not split over {tp_size} sequence-parallel ranks")
    n = seq_len // tp_size
    return tp_rank * n, (tp_rank + 1) * n


def real_token_mask(counts: list[int], *, padded_len: int, tp_rank: int = 0, tp_size: int = 1,
                    sequence_parallel: bool = False) -> torch.Tensor:
    """bool [local_tokens] in align_microbatch's BSHD order: True where the sample has a real route (position <
    counts[b]), False on padding."""
    grid = torch.arange(padded_len)[:, None] < torch.tensor(counts, dtype=torch.long)[None, :]      # [s, b]
    lo, hi = sequence_slice(padded_len, tp_rank, tp_size, sequence_parallel)
    return grid[lo:hi].reshape(-1)


def unalign_microbatch(idx: torch.Tensor, num_samples: int, *, padded_len: int, tp_rank: int = 0, tp_size: int = 1,
                       sequence_parallel: bool = False) -> tuple[int, torch.Tensor]:
    """The inverse of align_microbatch (BSHD) for one layer's router output [local_tokens, topk]: (first sequence
    position held, [positions, num_samples, topk])."""
    lo, hi = sequence_slice(padded_len, tp_rank, tp_size, sequence_parallel)
    if idx.shape[0] != (hi - lo) * num_samples:
        raise ValueError(f"router output of {idx.shape[0]} tokens for {num_samples} samples x {hi - lo} positions")
    return lo, idx.reshape(hi - lo, num_samples, idx.shape[-1])
