"""Lazy reader over an HF checkpoint directory's safetensors files (shared by the Megatron loader, the vLLM plugin
and the merged refit), in the text model's names.

A checkpoint of a *ForConditionalGeneration model (Qwen3.5/3.6-MoE as released) stores its text tower under
model.language_model.*: those tensors are read as model.* (transformers' own prefix change for these models). Tensors
no backbone parameter reads are set aside by prefix and counted (`left_out`): the vision tower (model.visual.*) and
MTP layers stored as mtp.* (Qwen3.5, Qwen3-Next). DeepSeek-V3's MTP layers (model.layers.{num_hidden_layers + i}) are
told apart by layer number instead (naming.split_mtp)."""
from __future__ import annotations

import json
from pathlib import Path

import torch


TEXT_TOWER = ("model.language_model.", "model.")
LEFT_OUT = ("model.visual.", "mtp.")
"""Prefixes of tensors that are not the text backbone's: the vision tower, MTP layers stored apart."""


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
        self.left_out = {p: sum(k.startswith(p) for k in weight_map) for p in LEFT_OUT}
        self.left_out = {p: n for p, n in self.left_out.items() if n}
        self._stored = {}                    # our name -> the name in the files
        for k in weight_map:
            if not k.startswith(LEFT_OUT):
                self._stored[TEXT_TOWER[1] + k[len(TEXT_TOWER[0]):] if k.startswith(TEXT_TOWER[0]) else k] = k
        self.text_tower = any(k.startswith(TEXT_TOWER[0]) for k in weight_map)
        self.stored_map = weight_map          # every tensor as stored (left-out ones included) -> its file
        self.weight_map = {n: weight_map[k] for n, k in self._stored.items()}
        self._handles = {f: safe_open(self.path / f, "pt") for f in set(weight_map.values())}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def stored_name(self, name: str) -> str:
        """The name in the files of a text-model tensor name (KeyError if absent)."""
        if name not in self._stored:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.path}")
        return self._stored[name]

    def get_stored(self, stored: str) -> torch.Tensor:
        """A tensor by its name in the files (stored_map), left-out ones included."""
        return self._handles[self.stored_map[stored]].get_tensor(stored)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.path}")
        return self._handles[self.weight_map[name]].get_tensor(self._stored[name])


def read_single_file(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a one-file checkpoint (model.safetensors), for the generators that add tensors to what
    transformers wrote (RuntimeError for a sharded one)."""
    if (Path(model_dir) / "model.safetensors.index.json").exists():
        raise RuntimeError(f"{model_dir}: a sharded checkpoint; the tiny generators write one file")
    from safetensors import safe_open

    with safe_open(Path(model_dir) / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}
