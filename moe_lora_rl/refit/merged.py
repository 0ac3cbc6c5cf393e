"""Full-weight refit: every checkpoint tensor, with W + scale * B @ A folded into the adapted ones (fp64 merge).
For comparison with the LoRA-only refit, and for engines that cannot serve LoRA."""
from __future__ import annotations

import re
from pathlib import Path

import torch


def merged_state(model_dir: str | Path, peft: dict[str, torch.Tensor], scale: float) -> list[tuple[str, torch.Tensor]]:
    from ..models.checkpoint import HFCheckpoint

    ck = HFCheckpoint(model_dir)
    delta = {}
    for k, A in peft.items():
        m = re.match(r"^base_model\.model\.(.+)\.lora_A\.weight$", k)
        if m:
            B = peft[k.replace("lora_A", "lora_B")]
            delta[m.group(1) + ".weight"] = (B.double() @ A.double()) * scale
    out = []
    for name in ck.weight_map:
        t = ck.get(name).float()
        if name in delta:
            t = (t.double() + delta.pop(name)).float()
        out.append((name, t))
    if delta:
        raise ValueError(f"merged refit: adapters for tensors not in the checkpoint: {sorted(delta)[:4]}")
    return out
