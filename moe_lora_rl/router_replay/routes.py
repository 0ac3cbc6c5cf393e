"""Routes that travel with a rollout batch: per sample, the top-k logical expert ids of every token for every MoE
layer, stored compactly (uint8 for <= 256 experts, else uint16), with the global layer number of each MoE layer.

A batch converts to and from one padded tensor (a verl DataProto field) plus per-sample lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def compact_dtype(num_experts: int):
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    return np.uint8 if num_experts <= 256 else np.uint16


@dataclass
class RoutesBatch:
    """samples[i]: [num_tokens_i, num_moe_layers, topk] expert ids; layer_ids: global layer number per MoE layer."""

    samples: list[np.ndarray]
    layer_ids: tuple[int, ...]
    num_experts: int
    topk: int

    def __post_init__(self):
        dt = compact_dtype(self.num_experts)
        fixed = []
        for i, r in enumerate(self.samples):
            r = np.asarray(r)
            if r.ndim != 3 or r.shape[1] != len(self.layer_ids) or r.shape[2] != self.topk:
                raise ValueError(f"routes of sample {i} have shape {r.shape}; expected [tokens, "
                                 f"{len(self.layer_ids)} MoE layers, top-k {self.topk}]")
            if r.size and (r.min() < 0 or r.max() >= self.num_experts):
                bad = np.argwhere((r < 0) | (r >= self.num_experts))[0]
                raise ValueError(f"routes of sample {i}: expert id {int(r[tuple(bad)])} at token {bad[0]}, "
                                 f"layer {self.layer_ids[bad[1]]} is out of range 0..{self.num_experts - 1}")
            fixed.append(r.astype(dt, copy=False))
        self.samples = fixed

    @property
    def bytes_per_token(self) -> int:
        return len(self.layer_ids) * self.topk * np.dtype(compact_dtype(self.num_experts)).itemsize

    def check_tokens(self, lengths: list[int]) -> None:
        """Each sample must have routes for exactly its tokens (prompt + response, without padding)."""
        if len(lengths) != len(self.samples):
            raise ValueError(f"routes for {len(self.samples)} samples, batch has {len(lengths)}")
        for i, (n, r) in enumerate(zip(lengths, self.samples)):
            if r.shape[0] != n:
                raise ValueError(f"sample {i}: routes cover {r.shape[0]} tokens, the sample has {n}")

    # -- a verl DataProto field: one padded int16 tensor + lengths ---------------------------------------------
    def to_field(self) -> dict[str, torch.Tensor]:
        n = max((r.shape[0] for r in self.samples), default=0)
        out = torch.full((len(self.samples), n, len(self.layer_ids), self.topk), -1, dtype=torch.int16)
        for i, r in enumerate(self.samples):
            out[i, : r.shape[0]] = torch.from_numpy(r.astype(np.int16))
        return {"routed_experts": out, "routed_experts_len": torch.tensor([r.shape[0] for r in self.samples]),
                "routed_experts_layers": torch.tensor(self.layer_ids)}

    @classmethod
    def from_field(cls, field: dict[str, torch.Tensor], num_experts: int) -> "RoutesBatch":
        t, lens = field["routed_experts"], field["routed_experts_len"].tolist()
        return cls([t[i, :n].numpy() for i, n in enumerate(lens)],
                   tuple(field["routed_experts_layers"].tolist()), num_experts, t.shape[-1])
