"""Run in its own process: LoRA-only push vs full merged-weight reload side by side on one in-process vLLM
engine (fp32), for `bench refit`. Prints one line "RESULT <json>"."""
from __future__ import annotations

import argparse
import json

from ...checks.vllm_logprobs import megatron_logprobs, prompt_logprobs
from ...rollout.vllm_engine import make_engine, set_engine_env


def bench(argv=None) -> dict:
    """Side by side on one engine: LoRA-only push vs full merged-weight reload."""
    set_engine_env()
    import torch

    from ...refit.rename import to_peft_tensors
    from ...models.arch import arch_from_hf_config
    from ...refit.merged import MergedInprocTransport
    from ...transfer.transports import InprocTransport
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--blob", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--alpha", type=float, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    arch = arch_from_hf_config(transformers.AutoConfig.from_pretrained(a.model))
    data = torch.load(a.data)[a.model]
    blob = torch.load(a.blob)
    seqs = data["eval"].tolist()
    want = megatron_logprobs(data["eval"], blob["eval_logits"])
    peft = to_peft_tensors(blob["adapters"], arch)
    llm = make_engine(a.model, dtype="float32", prefix_caching=False)
    tr = InprocTransport(llm)
    lora_s = []
    for i in range(a.repeats):
        lora_s.append(tr.push(i + 1, peft, a.rank, a.alpha).seconds)
    lora_diff = (prompt_logprobs(llm, seqs) - want).abs().max().item()
    full = MergedInprocTransport(llm, a.model)     # the trainer-side merge is part of the full refit's cost
    full_s, full_bytes = [], 0
    for i in range(a.repeats):
        r = full.push(i + 1, peft, a.rank, a.alpha)
        full_s.append(r.seconds)
        full_bytes = r.bytes
    merged_diff = (prompt_logprobs(llm, seqs) - want).abs().max().item()
    lora_bytes = sum(t.numel() * t.element_size() for t in peft.values())
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    res = {"model": a.model, "lora_bytes": lora_bytes, "full_bytes": full_bytes, "bytes_ratio": full_bytes / lora_bytes,
           "lora_refit_s": med(lora_s), "full_refit_s": med(full_s), "time_ratio": med(full_s) / med(lora_s),
           "logprob_max_diff_lora": lora_diff, "logprob_max_diff_merged": merged_diff}
    print("RESULT " + json.dumps(res))
    return res


if __name__ == "__main__":
    bench()
