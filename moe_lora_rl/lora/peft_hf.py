"""Load an exported PEFT adapter into HF transformers + peft (the consumer-side reference for export tests)."""
from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def peft_logits(model_dir: str | Path, adapter_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                             attn_implementation="eager")
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    n_lora = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A"))
    if n_lora == 0:
        raise AssertionError(f"peft attached no LoRA module from {adapter_dir}")
    return model(input_ids=tokens).logits.float()
