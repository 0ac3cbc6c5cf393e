"""lora.state.read_full: a checkpoint's adapter factors assembled whole from the slices ranks saved (any layout),
without a model; a missing slice is refused naming the factor."""
import json

import pytest
import torch
from safetensors.torch import save_file

from moe_lora_rl.lora.config import LoRAConfig
from moe_lora_rl.lora.state import META_KEY, read_full


def write(d, rank, slices):
    tensors = {f"{n}@{lo}": t for n, lo, _, _, t in slices}
    index = {f"{n}@{lo}": {"name": n, "global_shape": list(shape), "dim": dim, "start": lo,
                           "stop": lo + (t.shape[dim] if dim is not None else 0)}
             for n, lo, shape, dim, t in slices}
    save_file(tensors, str(d / f"adapter-{rank:05d}.safetensors"), metadata={META_KEY: json.dumps(index)})


def test_slices_of_two_ranks_assemble_and_a_missing_one_is_refused(tmp_path):
    cfg = LoRAConfig(rank=4, alpha=8.0)
    (tmp_path / "lora_config.json").write_text(json.dumps(cfg.to_dict()))
    a = torch.randn(6, 4, 8)                                   # [experts, r, in], split over 2 ranks on dim 0
    b = torch.randn(5, 3)                                      # whole on rank 0
    write(tmp_path, 0, [("l1.experts.A", 0, a.shape, 0, a[:3].clone()), ("l1.attn.B", 0, b.shape, None, b)])
    write(tmp_path, 1, [("l1.experts.A", 3, a.shape, 0, a[3:].clone())])
    full, got_cfg = read_full(tmp_path)
    assert torch.equal(full["l1.experts.A"], a) and torch.equal(full["l1.attn.B"], b)
    assert got_cfg.to_dict() == cfg.to_dict()
    (tmp_path / "adapter-00001.safetensors").unlink()          # control: rank 1's slice lost
    with pytest.raises(ValueError, match=r"l1.experts.A is only partly present"):
        read_full(tmp_path)
    with pytest.raises(ValueError, match="no lora_config.json"):
        read_full(tmp_path / "nowhere")
