"""LoRA adapters on megatron-core linears, attached as a child module plus a forward hook (base names unchanged).

    y = base(x) + scale * B(A(dropout(x)))        with the sequence-parallel collective of the rank-r activation
                                                  that the sharding rule asks for (see sharding.py)
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from .sharding import FactorRule, LinearRule


@dataclass(frozen=True)
class FactorMeta:
    """Where a local factor sits in its global (canonical) tensor. GLU B factors are canonically [2, out, r]
    (gate, up) so that an ETP/TP shard is one contiguous slice along dim 1. Blocked B factors (the delta-net's
    in_proj: `blocks` = its rows per key head, by section) are canonically [key heads, sum(blocks), r], sharded on
    dim 0; the parameter holds its heads in that order and the adapter reorders the output (section_major_rows)."""

    global_name: str
    global_shape: tuple[int, ...]
    shard_dim: int | None          # in canonical coordinates
    group: str | None              # "tp" | "etp" | None
    reduce: tuple[str, ...]
    glu: bool = False
    target: str = ""               # the LoRA target of the base linear (lora/config.py), "" when not known
    blocks: tuple[int, ...] = ()   # rows per head of each output section, in the base's section order

    def canonical(self, local: torch.Tensor) -> torch.Tensor:
        if self.blocks:
            return local.view(-1, sum(self.blocks), local.shape[-1])
        return local.view(2, -1, local.shape[-1]) if self.glu else local

    def local_shape(self, rank_size: int) -> tuple[int, ...]:
        shape = list(self.global_shape)
        if self.shard_dim is not None:
            shape[self.shard_dim] //= rank_size
        return (shape[0] * shape[1], shape[2]) if self.glu or self.blocks else tuple(shape)


def delta_net_blocks(key_head_dim: int, value_head_dim: int, key_heads: int, value_heads: int) -> tuple[int, ...]:
    """The delta-net's in_proj rows per key head by section [q, k, v, z, b, a]: a TP rank holds whole key heads and
    their value heads (value head j belongs to key head j // (value_heads / key_heads))."""
    m = value_heads // key_heads
    return (key_head_dim, key_head_dim, m * value_head_dim, m * value_head_dim, m, m)


def section_major_rows(blocks: tuple[int, ...], heads: int) -> torch.Tensor:
    """Index of the head-major B rows ([head][section][row], `heads` local heads) that each output row of a
    section-major base ([section][head][row]: megatron's GatedDeltaNet.in_proj per TP rank) takes."""
    starts = [sum(blocks[:s]) for s in range(len(blocks))]
    unit = sum(blocks)
    return torch.tensor([h * unit + starts[s] + j for s, n in enumerate(blocks) for h in range(heads)
                         for j in range(n)], dtype=torch.int64)


def seeded_uniform(shape: tuple[int, ...], bound: float, seed: int, name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:15], 16))
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul(bound).float()


def make_factor(meta: FactorMeta, rank: int, size: int, *, init: str, seed: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> nn.Parameter:
    """Build the local shard of a factor from its global initialisation (layout- and device-independent: drawn on
    the CPU, then placed on `device`, the base weights' device)."""
    if init == "zeros":
        full = torch.zeros(meta.global_shape)
    elif init == "kaiming":  # kaiming-uniform(a=sqrt(5)) on fan_in, as nn.Linear / PEFT's LoRA A
        fan_in = meta.global_shape[-1]
        full = seeded_uniform(meta.global_shape, 1.0 / math.sqrt(fan_in), seed, meta.global_name)
    elif init == "xavier":   # xavier-uniform of one [r, in] A, as Megatron-Bridge's lora_A_init_method="xavier"
        fan_out, fan_in = meta.global_shape[-2], meta.global_shape[-1]
        full = seeded_uniform(meta.global_shape, math.sqrt(6.0 / (fan_in + fan_out)), seed, meta.global_name)
    else:
        raise ValueError(f"init={init!r}: choose zeros, kaiming or xavier")
    if meta.shard_dim is not None:
        full = full.chunk(size, dim=meta.shard_dim)[rank]
    local = full.reshape(meta.local_shape(size)).contiguous()
    p = nn.Parameter(local.to(device=device, dtype=dtype))
    p.lora_meta = meta
    return p


class LoRAAdapter(nn.Module):
    """The adapter of one base linear. Owned factors are registered here; factors shared by several experts are
    registered once on the experts module and only referenced here."""

    def __init__(self, rule: LinearRule, scale: float, dropout: float, A: nn.Parameter, B: nn.Parameter,
                 own_A: bool, own_B: bool, tp_group=None, row_order: torch.Tensor | None = None):
        super().__init__()
        self.rule, self.scale = rule, scale
        # B's rows in the base's output order (section_major_rows), or None; a buffer, so it moves with the module
        self.register_buffer("row_order", row_order, persistent=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.tp_group = tp_group
        if own_A:
            self.A = A
        else:
            object.__setattr__(self, "_A", A)
        if own_B:
            self.B = B
        else:
            object.__setattr__(self, "_B", B)

    @property
    def factor_A(self) -> nn.Parameter:
        return self.A if "A" in self._parameters else self._A

    @property
    def factor_B(self) -> nn.Parameter:
        return self.B if "B" in self._parameters else self._B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        A, B = self.factor_A, self.factor_B
        if self.row_order is not None:
            B = B.index_select(0, self.row_order)
        h = torch.matmul(self.dropout(x).to(A.dtype), A.t())
        if self.rule.seq_comm == "gather":
            h = mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
        elif self.rule.seq_comm == "scatter":
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        return torch.matmul(h, B.t()) * self.scale


def _hook(module, args, kwargs, output):
    x = args[0] if args else kwargs.get("input_", kwargs.get("input"))
    out, bias = output
    delta = module.lora(x)
    return out + delta.to(out.dtype), bias


def attach(linear: nn.Module, adapter: LoRAAdapter) -> None:
    linear.lora = adapter
    linear._lora_hook = linear.register_forward_hook(_hook, with_kwargs=True)


def detach(linear: nn.Module) -> None:  # also undoes grouped.attach_te_grouped
    linear._lora_hook.remove()
    del linear._lora_hook
    del linear.lora


def adapter_factors(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """All adapter parameters, each once, in a deterministic order (identical across ranks of a group)."""
    return [(n, p) for n, p in model.named_parameters() if hasattr(p, "lora_meta")]


__all__ = ["FactorMeta", "FactorRule", "LoRAAdapter", "attach", "detach", "adapter_factors", "make_factor"]
