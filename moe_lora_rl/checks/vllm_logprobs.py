"""The per-token log-probs the refit checks compare: vLLM's prompt log-probs of token sequences against the
Megatron+LoRA logits' (fp64 log-softmax), token t given tokens < t."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def prompt_logprobs(llm, seqs) -> torch.Tensor:
    import torch
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    rows = []
    for s, o in zip(seqs, outs):
        rows.append([o.prompt_logprobs[t][s[t]].logprob for t in range(1, len(s))])
    return torch.tensor(rows, dtype=torch.float64)


def megatron_logprobs(eval_tokens, eval_logits):
    import torch

    lp = torch.log_softmax(eval_logits.double(), -1)
    return lp[:, :-1].gather(-1, eval_tokens[:, 1:, None])[..., 0]
