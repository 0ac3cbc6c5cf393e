"""The one evaluator of bench peers: held-out success of a final PEFT adapter (any peer's) on the base model, by
plain HF transformers + peft in fp32, on the same held-out problems, samples and sampling seeds for every run.

    evaluate(model_dir, adapter_dir, task="sort")  ->  {"success": s, "n": samples scored}
    (adapter_dir None: the base)
"""
from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def evaluate(model_dir: str | Path, adapter_dir: str | Path | None, *, n_eval: int = 256, samples: int = 4,
             seed: int = 0, threads: int = 2, task: str = "sort") -> dict:
    import transformers

    from ...data.hf_sampling import generate, prompt_ids, score
    from ...data.task import make_split
    from .peer_task import peer_task

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter_dir))
            if not any(n.endswith("lora_A") for n, _ in model.named_modules()):
                raise ValueError(f"{adapter_dir}: peft attached no LoRA module to {model_dir}")
            model = model.merge_and_unload()
        model.eval()
        spec, max_tokens, _ = peer_task(task, n_eval)
        problems = make_split(spec, "eval")
        prompts = prompt_ids(tok, problems)
        hits = []
        for s in range(samples):
            resp = generate(model, tok, prompts, max_new_tokens=max_tokens, greedy=False, seed=seed * 1000 + s)
            hits.append(score(tok, problems, resp))
    finally:
        torch.set_num_threads(old)
    flat = [h for row in hits for h in row]
    return {"success": sum(flat) / len(flat), "n": len(flat)}
