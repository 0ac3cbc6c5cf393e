"""The policy's global batch and what a logprob pass returns (pure data, validated on construction)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..router_replay.routes import RoutesBatch


@dataclass
class PolicyBatch:
    """The step's global batch, identical on every rank."""
    tokens: torch.Tensor                      # [N, S] int64, prompt + response, right-padded
    lengths: list[int]                        # real tokens per row (prompt + response)
    loss_mask: torch.Tensor                   # [N, S-1] bool: True where label tokens[:, 1:] is a response token
    advantages: torch.Tensor                  # [N, S-1] float32 token-level (0 outside loss_mask)
    rollout_logprobs: torch.Tensor | None     # [N, S-1] float32 rollout logprobs of the labels (0 outside loss_mask)
    routes: RoutesBatch | None                # samples[i]: [lengths[i]-1, n_moe_layers, topk]
    group_ids: list[int]                      # prompt id per row (GRPO groups)
    kv_kept: list | None = None               # KV replay: per row the sampler's eviction record (kv_masks.py)

    def __post_init__(self):
        t = self.tokens
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.int64:
            raise ValueError(f"tokens must be an int64 [N, S] tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        n, s = t.shape
        if n == 0 or s < 2:
            raise ValueError(f"tokens of shape {(n, s)}: need at least one row of at least 2 tokens")
        self.lengths = [int(x) for x in self.lengths]
        if len(self.lengths) != n or any(not 2 <= x <= s for x in self.lengths):
            raise ValueError(f"lengths {self.lengths} must be {n} values in 2..{s}")
        if len(self.group_ids) != n:
            raise ValueError(f"{len(self.group_ids)} group ids for {n} rows")
        if self.kv_kept is not None and len(self.kv_kept) != n:
            raise ValueError(f"{len(self.kv_kept)} kv replay records for {n} rows")
        for name in ("loss_mask", "advantages", "rollout_logprobs"):
            v = getattr(self, name)
            if v is None and name == "rollout_logprobs":
                continue
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (n, s - 1):
                raise ValueError(f"{name} has shape {tuple(getattr(v, 'shape', ()))}, expected {(n, s - 1)}")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"loss_mask must be bool, got {self.loss_mask.dtype}")
        outside = self.loss_mask & ~self.label_mask()
        if outside.any():
            row, col = (int(x) for x in outside.nonzero()[0])
            raise ValueError(f"loss_mask is True at row {row}, position {col}: beyond the row's last label "
                             f"(length {self.lengths[row]})")

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def label_mask(self) -> torch.Tensor:
        """[N, S-1] bool: position t has a real label (t < lengths[i] - 1)."""
        return torch.arange(self.seq_len - 1)[None, :] < (torch.tensor(self.lengths)[:, None] - 1)


@dataclass
class LogprobResult:
    logprobs: torch.Tensor                      # [N, S-1] fp32 on every rank (0 where the label is padding)
    disagreement: dict[int, float] | None       # r3: per global MoE layer, fraction of routed-token decisions
    recorded: RoutesBatch | None                # record: this pass's routes in the capture format
    token_disagreement: float | None = None     # r3: fraction of routed tokens differing in >= 1 MoE layer
