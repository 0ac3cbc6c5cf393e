"""Local and global layer / expert numbers (pure): a rank's offsets, which rank owns a global layer and expert
under an even split, the layer number in any system's name, and DeepSeek-V3's MTP layers set apart."""
from __future__ import annotations

import re
from dataclasses import dataclass


def split_mtp(names, num_layers: int) -> tuple[list[str], list[str]]:
    """(backbone, MTP) tensor names of a checkpoint: DeepSeek-V3's multi-token-prediction layers are stored as
    model.layers.{num_layers + i}.* (num_nextn_predict_layers of them); no builder maps them onto a layer."""
    backbone, mtp = [], []
    for n in names:
        layer = layer_of(n)
        (mtp if layer is not None and layer >= num_layers else backbone).append(n)
    return backbone, mtp


@dataclass(frozen=True)
class Offsets:
    """Local -> global numbering on one rank: global layer = local + layer, global expert = local + expert."""
    layer: int = 0
    expert: int = 0

    @staticmethod
    def for_rank(first_layer: int, ep_rank: int, ep_size: int, num_experts: int) -> "Offsets":
        """first_layer: the stage's first global layer (0-based); experts are split evenly over EP ranks."""
        if num_experts and num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by expert parallel size {ep_size}")
        return Offsets(first_layer, ep_rank * (num_experts // ep_size if num_experts else 0))


def owner(global_layer: int, global_expert: int | None, *, num_layers: int, pp: int, num_experts: int,
          ep: int) -> tuple[int, int, Offsets]:
    """(pipeline stage, EP rank, that rank's offsets) holding a global layer / expert under an even split."""
    if num_layers % pp:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline parallel size {pp}")
    per_stage = num_layers // pp
    stage = global_layer // per_stage
    ep_rank = 0 if global_expert is None else global_expert // (num_experts // ep)
    return stage, ep_rank, Offsets.for_rank(stage * per_stage, ep_rank, ep, num_experts)


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The layer number in any of the systems' names (HF, Megatron, canonical, PEFT, vLLM modules), or None."""
    m = _LAYER_NUMBER.search(name)
    return int(m.group(1)) if m else None
