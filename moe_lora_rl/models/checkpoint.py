"""Lazy reader over an HF checkpoint directory's safetensors files (shared by the Megatron loader, the vLLM plugin
and the merged refit)."""
from __future__ import annotations

import json
from pathlib import Path

import torch


class HFCheckpoint:
    """Lazy reader over the (possibly sharded) safetensors files of an HF checkpoint directory."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"no safetensors files in checkpoint directory {self.path}")
            weight_map = {}
            for f in files:
                with safe_open(f, "pt") as s:
                    weight_map.update({k: f.name for k in s.keys()})
        self.weight_map = weight_map
        self._handles = {f: safe_open(self.path / f, "pt") for f in set(weight_map.values())}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.path}")
        return self._handles[self.weight_map[name]].get_tensor(name)
