"""The per-token R3 check inside a verl run: the trainer's log-prob recompute with the rollout's routes replayed, and
the same recompute with the trainer's own routing, each against the rollout's log-probs of the same tokens.

    k3 = mean over response tokens of exp(d) - 1 - d,   d = log p_trainer(token) - log p_rollout(token)

(the k3 estimator of KL(rollout || trainer) on the rollout's own samples, verl's token_k3). In fp32 with the
rollout's routes replayed the two policies are one (k3 ~ 1e-10); with the trainer routing on its own, near-tied
router scores flip experts and k3 is orders larger. One JSON line per recompute (data-parallel ranks write their
own shard; tensor-parallel ranks other than 0 write nothing).
"""
from __future__ import annotations

import json
import os

import torch


def k3_stats(lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> dict:
    """lp, rollout_lp, mask: [bsz, response_len] -> k3 and the largest |d| over the masked tokens."""
    m = mask.bool()
    d = (lp.double() - rollout_lp.double())[m]
    if d.numel() == 0:
        raise ValueError("r3 check: no response tokens in the batch")
    return {"k3": float((torch.exp(d) - 1 - d).mean()), "max_abs_diff": float(d.abs().max())}


def record(path: str, data, replayed: dict, free: dict, *, version: int | None = None) -> dict:
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
    if ps.get_tensor_model_parallel_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    return line
