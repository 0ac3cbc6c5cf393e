"""The per-token R3 check inside a verl run: the trainer's log-prob recompute with the rollout's routes replayed, the
same recompute with the trainer's own routing, and (the negative control) with the rollout's routes shifted by one
token in every sample, each against the rollout's log-probs of the same tokens.

    k3 = mean over response tokens of exp(d) - 1 - d,   d = log p_trainer(token) - log p_rollout(token)

(the k3 estimator of KL(rollout || trainer) on the rollout's own samples, verl's token_k3). In fp32 with the
rollout's routes replayed the two policies are one (k3 ~ 1e-10); with the trainer routing on its own, near-tied
router scores flip experts where the two sides' numerics differ (bf16 rollouts; in fp32 they agree and so does k3);
with routes one token off, every token runs other experts and k3 is large: what misaligned routes would give. One JSON line per recompute (data-parallel ranks write their
own shard; tensor-parallel ranks other than 0 write nothing).
"""
from __future__ import annotations

import json
import os

import torch


def k3_stats(lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> dict:
    """lp, rollout_lp, mask: [bsz, response_len] -> k3 and the largest |d| over the masked tokens."""
    from ...mismatch import k3_kl

    m = mask.bool()
    if not m.any():
        raise ValueError("r3 check: no response tokens in the batch")
    d = (lp.double() - rollout_lp.double())[m]
    return {"k3": k3_kl(d, torch.zeros_like(d)), "max_abs_diff": float(d.abs().max())}


def shifted_routes(data):
    """A shallow copy of the batch whose routed_experts are rolled by one token within each sample."""
    copy = data.copy()
    re = data["routed_experts"]
    rows = list(re.unbind()) if re.is_nested else [re[i] for i in range(re.shape[0])]
    rolled = [torch.roll(r, 1, dims=0) for r in rows]
    copy["routed_experts"] = (torch.nested.as_nested_tensor(rolled, layout=torch.jagged) if re.is_nested
                              else torch.stack(rolled))
    return copy


def record(path: str, data, replayed: dict, free: dict, shifted: dict | None = None, *,
           version: int | None = None) -> dict:
    from megatron.core import parallel_state as ps
    from verl.workers.utils.padding import no_padding_2_padding

    rollout_lp, mask = data["rollout_log_probs"], data["response_mask"]
    rep = no_padding_2_padding(replayed["model_output"]["log_probs"], data)
    own = no_padding_2_padding(free["model_output"]["log_probs"], data)
    n = min(rep.shape[1], rollout_lp.shape[1])
    a = k3_stats(rep[:, :n], rollout_lp[:, :n], mask[:, :n])
    b = k3_stats(own[:, :n], rollout_lp[:, :n], mask[:, :n])
    line = {"version": version, "dp_rank": ps.get_data_parallel_rank(), "tokens": int(mask[:, :n].sum()),
            "k3_replay": a["k3"], "k3_free": b["k3"], "max_abs_diff_replay": a["max_abs_diff"],
            "max_abs_diff_free": b["max_abs_diff"]}
    if shifted is not None:
        c = k3_stats(no_padding_2_padding(shifted["model_output"]["log_probs"], data)[:, :n], rollout_lp[:, :n],
                     mask[:, :n])
        line["k3_shifted"] = c["k3"]
    if ps.get_tensor_model_parallel_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    return line
