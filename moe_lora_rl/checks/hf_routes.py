"""HF transformers as a stand-in rollout engine for Megatron-side replay tests: routes (top-k ids per MoE layer)
and token logprobs of a bf16 forward, recorded through forward hooks on the HF routers."""
from __future__ import annotations

import numpy as np
import torch

from ..router_replay.routes import RoutesBatch


@torch.no_grad()
def hf_rollout_routes(hf_model, samples: list[torch.Tensor]) -> tuple[RoutesBatch, list[torch.Tensor]]:
    """Per sample (1-D token tensors): routes [T, moe_layers, k] and logprobs of tokens 1..T-1 [T-1]."""
    layers = [i for i, l in enumerate(hf_model.model.layers) if hasattr(l.mlp, "experts")]
    cfg = hf_model.config
    n_exp = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    out, lps = [], []
    for s in samples:
        got: dict[int, torch.Tensor] = {}
        hooks = [hf_model.model.layers[i].mlp.gate.register_forward_hook(
            lambda m, a, o, i=i: got.__setitem__(i, o[-1].reshape(-1, cfg.num_experts_per_tok)))
            for i in layers]
        try:
            logits = hf_model(input_ids=s[None]).logits[0].float()
        finally:
            for h in hooks:
                h.remove()
        out.append(np.stack([got[i].numpy() for i in layers], axis=1))
        lps.append(torch.log_softmax(logits, -1)[:-1].gather(-1, s[1:, None])[:, 0])
    return RoutesBatch(out, tuple(layers), n_exp, cfg.num_experts_per_tok), lps
