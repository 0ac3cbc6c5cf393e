"""Multi-LoRA batching of one engine step (Punica / S-LoRA style; runtime.py's LoRARuntime plans and applies it):
TokenGroups: the adapter version of every token of the step, grouped, planned once before the forward;
linear_delta: s * B(A(x)) of one (fused) linear for the rows of one group."""
from __future__ import annotations

import numpy as np
import torch


def linear_delta(x: torch.Tensor, mods: dict, parts: tuple[str, ...], sizes: list[int], scale: float) -> torch.Tensor:
    """s * B(A(x)) of one (fused) linear in fp32 [rows, sum(sizes)]: one slice per part, zeros for parts the
    adapter does not have."""
    deltas = []
    for p, n in zip(parts, sizes):
        if p in mods:
            A, B = mods[p]
            deltas.append(((x.to(A.dtype) @ A.t()) @ B.t()) * scale)
        else:
            deltas.append(x.new_zeros(*x.shape[:-1], n, dtype=torch.float32))
    return torch.cat(deltas, dim=-1)


class TokenGroups:
    """The adapter version of every token of one step, grouped: [(version, token indices), ...]. Tokens past the
    step's own (padding the forward adds) join the last request's version. One version: [(version, None)]."""

    def __init__(self, versions: list, query_start_loc: np.ndarray):
        self.versions = list(dict.fromkeys(versions))                        # distinct, first appearance order
        code = {v: c for c, v in enumerate(self.versions)}
        self.codes = np.repeat([code[v] for v in versions], np.diff(query_start_loc)).astype(np.int64)
        self._cache: dict = {}

    def groups(self, num_tokens: int, device) -> list:
        if len(self.versions) == 1:
            return [(self.versions[0], None)]
        key = (num_tokens, str(device))
        if key not in self._cache:
            n = len(self.codes)
            assert num_tokens >= n, f"a forward of {num_tokens} tokens in a step of {n} planned tokens"
            codes = np.concatenate([self.codes, np.full(num_tokens - n, self.codes[-1] if n else 0)])
            self._cache[key] = [(v, torch.from_numpy(np.flatnonzero(codes == c)).to(device))
                                for c, v in enumerate(self.versions) if (codes == c).any()]
        return self._cache[key]
