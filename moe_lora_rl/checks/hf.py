"""HF transformers oracle (fp32, eager attention): the reference outputs for the same tokens Megatron sees."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def hf_model(path: str):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return m.eval()


@torch.no_grad()
def hf_logits(path: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    return hf_model(str(path))(input_ids=tokens).logits.float()
