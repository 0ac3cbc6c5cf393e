"""Full-weight refit: every checkpoint tensor, with W + scale * B @ A folded into the adapted ones (fp64 merge).
For comparison with the LoRA-only refit, and for engines that cannot serve LoRA."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def merged_state(model_dir: str | Path, peft: dict[str, torch.Tensor], scale: float) -> list[tuple[str, torch.Tensor]]:
    from ..models.checkpoint import HFCheckpoint
    from ..models.arch import arch_from_hf_config
    from ..models.naming import naming_for

    ck = HFCheckpoint(model_dir)
    naming = naming_for(arch_from_hf_config(json.loads((Path(model_dir) / "config.json").read_text())))
    delta = {}
    for k, A in peft.items():
        name, part, ab = naming.parse_peft(k)
        if ab == "A":
            B = peft[k.replace(".lora_A.", ".lora_B.")]
            delta[naming.hf_modules(name)[part] + ".weight"] = (B.double() @ A.double()) * scale
    out = []
    for name in ck.weight_map:
        t = ck.get(name).float()
        if name in delta:
            t = (t.double() + delta.pop(name)).float()
        out.append((name, t))
    if delta:
        raise ValueError(f"merged refit: adapters for tensors not in the checkpoint: {sorted(delta)[:4]}")
    return out
