"""The verl engine launch's batch (verl_worker.py, verl_adapter_path.py): one global GRPO batch in verl's rollout
layout, the log-probs and entropies of its response tokens from full logits, and a DP rank's rows as verl's trainer
hands them to the worker."""
from __future__ import annotations

import numpy as np
import torch

N, GROUP, TEMPERATURE, MICRO = 8, 4, 0.7, 2


def make_batch(arch, seed: int = 0) -> dict:
    """Left-padded prompts, right-padded responses (verl's rollout layout), rewards, forced routes per real token."""
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(3, 7, N), rng.integers(3, 8, N)
    P, R = int(plen.max()), int(rlen.max())
    prompts = torch.zeros(N, P, dtype=torch.long)
    responses = torch.zeros(N, R, dtype=torch.long)
    attn = torch.zeros(N, P + R, dtype=torch.long)
    for i in range(N):
        prompts[i, P - plen[i]:] = torch.from_numpy(rng.integers(1, arch.vocab_size, plen[i]))
        responses[i, : rlen[i]] = torch.from_numpy(rng.integers(1, arch.vocab_size, rlen[i]))
        attn[i, P - plen[i]: P + rlen[i]] = 1
    resp_mask = attn[:, P:].clone()
    routes = [np.argsort(rng.random((plen[i] + rlen[i], arch.num_layers, arch.num_experts)), -1)[..., : arch.topk]
              for i in range(N)]                                 # distinct experts per token, every layer
    rewards = torch.from_numpy(rng.random(N)).float()
    return dict(prompts=prompts, responses=responses, attn=attn, resp_mask=resp_mask, plen=plen, rlen=rlen, P=P, R=R,
                routes=routes, rewards=rewards, noise=torch.from_numpy(rng.normal(0, 0.05, (N, R))).float())


def real_tokens(b) -> list[torch.Tensor]:
    ids = torch.cat([b["prompts"], b["responses"]], 1)
    return [ids[i][b["attn"][i].bool()] for i in range(N)]


def response_logprobs(logits: torch.Tensor, seqs: list[torch.Tensor], b) -> torch.Tensor:
    """[N, R] log p(response token) from full logits [N, S, V] of right-padded real sequences."""
    lp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    out = torch.zeros(N, b["R"])
    for i, s in enumerate(seqs):
        p, r = int(b["plen"][i]), int(b["rlen"][i])
        out[i, :r] = lp[i, p - 1: p + r - 1].gather(-1, s[p: p + r, None]).squeeze(-1)
    return out


def response_entropy(logits: torch.Tensor, b) -> torch.Tensor:
    """[N, R] entropy of the distribution predicting each response token (temperature applied)."""
    lg = logits.float() / TEMPERATURE
    ent = torch.logsumexp(lg, -1) - (torch.softmax(lg, -1) * lg).sum(-1)
    out = torch.zeros(N, b["R"])
    for i in range(N):
        p, r = int(b["plen"][i]), int(b["rlen"][i])
        out[i, :r] = ent[i, p - 1: p + r - 1]
    return out


def response_logprobs_autograd(logits_local, seqs, b, vocab):
    from ..megatron.forward import gather_vocab

    logits = gather_vocab(logits_local, vocab).float()
    lp = torch.log_softmax(logits / TEMPERATURE, -1)
    rows = []
    for i, s in enumerate(seqs):
        p, r = int(b["plen"][i]), int(b["rlen"][i])
        row = lp[i, p - 1: p + r - 1].gather(-1, s[p: p + r, None].to(lp.device)).squeeze(-1)
        rows.append(torch.nn.functional.pad(row, (0, b["R"] - r)))
    return torch.stack(rows)


def verl_batch(b, old, adv, rows, routes: bool):
    """The DP rank's rows as verl's trainer hands them to the worker (left_right_2_no_padding)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    attn = b["attn"][rows]
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    fields = dict(prompts=b["prompts"][rows], responses=b["responses"][rows],
                  input_ids=torch.cat([b["prompts"], b["responses"]], 1)[rows], attention_mask=attn,
                  position_ids=pos, response_mask=b["resp_mask"][rows], old_log_probs=old[rows], advantages=adv[rows])
    if routes:
        full = torch.zeros(len(rows), b["P"] + b["R"], *b["routes"][0].shape[1:], dtype=torch.int16)
        for j, i in enumerate(rows):
            full[j, b["P"] - b["plen"][i]: b["P"] + b["rlen"][i]] = torch.from_numpy(b["routes"][i].astype(np.int16))
        fields["routed_experts"] = full
    td = left_right_2_no_padding(TensorDict(fields, batch_size=len(rows)))
    tu.assign_non_tensor(td, temperature=TEMPERATURE, global_batch_size=N, compute_loss=False)
    return td
