"""Plain HF transformers sampling and held-out evaluation for the synthetic task (the warm start and the
pure-PyTorch GRPO reference loop use it; the production rollout is vLLM)."""
from __future__ import annotations

import torch

from .reward import compute_score
from .task import Problem


def prompt_ids(tokenizer, problems: list[Problem], template: str = "chat") -> list[list[int]]:
    """The prompts' token ids (data/prompting.py: the chat template, or plain)."""
    from .prompting import encode_prompts

    return encode_prompts(tokenizer, problems, template)


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):] = torch.tensor(s)
        mask[i, n - len(s):] = 1
    return ids, mask


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, greedy: bool,
             seed: int, temperature: float = 1.0) -> list[list[int]]:
    """Response token ids per prompt, cut after the first end-of-turn token (kept)."""
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=not greedy,
                         temperature=temperature if not greedy else None, top_k=0 if not greedy else None,
                         top_p=1.0 if not greedy else None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    resp = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        resp.append(row[:cut])
    return resp


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad: int):
    """Per-token log-probs [B, T] of each response given its prompt (left-padded prompt, right-padded response)."""
    P = max(len(p) for p in prompts)
    T = max(len(r) for r in responses)
    ids = torch.full((len(prompts), P + T), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    mask = torch.zeros((len(prompts), T))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(r)] = torch.tensor(r)
        att[i, P - len(p):P + len(r)] = 1
        mask[i, :len(r)] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, P - 1:P + T - 1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, P:P + T, None]).squeeze(-1)
    return logp, mask


def score(tokenizer, problems: list[Problem], responses: list[list[int]]) -> list[float]:
    return [compute_score(p.data_source, tokenizer.decode(r, skip_special_tokens=True), p.answer)
            for p, r in zip(problems, responses)]


def evaluate(model, tokenizer, problems: list[Problem], *, greedy: bool, seed: int, batch: int = 256,
             max_new_tokens: int = 8) -> float:
    """Held-out success rate: one response per problem."""
    was_training = model.training
    model.eval()
    hits = 0.0
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        resp = generate(model, tokenizer, prompt_ids(tokenizer, chunk), max_new_tokens=max_new_tokens,
                        greedy=greedy, seed=seed + i)
        hits += sum(score(tokenizer, chunk, resp))
    model.train(was_training)
    return hits / len(problems)
