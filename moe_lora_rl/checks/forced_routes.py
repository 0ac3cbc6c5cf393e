"""Forced-route reference: HF transformers with every MoE layer's top-k forced to given expert ids.

    routes of one sample (rollout format [tokens, moe_layers, top_k]) -> per MoE layer of the HF model, in layer order,
    the router's expert choice replaced by those ids -> gating weights from HF's own router scores at those ids
    (softmax family: softmax over all experts, renormalised over the top-k when norm_topk_prob; sigmoid family: the
    sigmoid scores without the selection bias, group-limited selection skipped, renormalised as the config says,
    times routed_scaling_factor) -> logits.

This is the reference Router Replay is checked against. It reads the routes with its own indexing and imports
nothing from moe_lora_rl.router_replay, so a bug in the alignment cannot hide in both sides.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch


def _softmax_gates(gate, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if getattr(gate, "norm_topk_prob", True):                # Qwen3.5-MoE's router always renormalises
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(logits.dtype)


def _sigmoid_gates(gate, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = logits.sigmoid().gather(1, ids)                     # e_score_correction_bias only steers the selection
    if gate.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * gate.routed_scaling_factor


def _softmax_logits(gate, hidden: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)


def _sigmoid_logits(gate, hidden: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim).float(), gate.weight.float())


# router class -> (router logits as HF computes them, gating weights at forced ids)
GATES = {
    "Qwen3MoeTopKRouter": (_softmax_logits, _softmax_gates),
    "Qwen3_5MoeTopKRouter": (_softmax_logits, _softmax_gates),
    "Qwen3NextTopKRouter": (_softmax_logits, _softmax_gates),
    "Glm4MoeTopkRouter": (_sigmoid_logits, _sigmoid_gates),
    "DeepseekV3TopkRouter": (_sigmoid_logits, _sigmoid_gates),     # the same routing (glm4_moe is its stand-in)
}


def moe_gates(hf_model) -> list:
    """The router module of every MoE layer, in layer order (dense layers have none)."""
    gates = []
    for layer in hf_model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue
        if type(gate).__name__ not in GATES:
            raise ValueError(f"router {type(gate).__name__} has no forced-route rule; known: {sorted(GATES)}")
        gates.append(gate)
    return gates


def check_routes(gates: list, routes: np.ndarray, num_tokens: int) -> None:
    """routes [tokens, moe_layers, top_k] must fit the model: ValueError naming the first value that does not."""
    r = np.asarray(routes)
    if r.ndim != 3:
        raise ValueError(f"routes of shape {r.shape}: expected [tokens, moe_layers, top_k]")
    if r.shape[0] != num_tokens:
        raise ValueError(f"routes cover {r.shape[0]} tokens, the sample has {num_tokens}")
    if r.shape[1] != len(gates):
        raise ValueError(f"routes for {r.shape[1]} MoE layers, the model has {len(gates)}")
    k, e = gates[0].top_k, gates[0].num_experts
    if r.shape[2] != k:
        raise ValueError(f"routes with top-k {r.shape[2]}, the model routes to {k} experts per token")
    if r.size and (r.min() < 0 or r.max() >= e):
        raise ValueError(f"expert id {int(r.min() if r.min() < 0 else r.max())} is out of range 0..{e - 1}")
    srt = np.sort(r, axis=-1)
    if k > 1 and (srt[..., 1:] == srt[..., :-1]).any():
        t, l = np.argwhere((srt[..., 1:] == srt[..., :-1]).any(-1))[0]
        raise ValueError(f"token {t}, MoE layer {l}: expert ids {r[t, l].tolist()} repeat an expert")


@contextmanager
def forced(gates: list, per_layer: list[torch.Tensor], own_topk: list | None = None):
    """Within the block, MoE layer j routes its tokens to per_layer[j] ([tokens, top_k]); own_topk (a list) receives
    what each router would have chosen itself on the same inputs. A scoped instance-level forward, removed on exit."""
    def make(gate, ids):
        logits_fn, gates_fn = GATES[type(gate).__name__]
        original = type(gate).forward

        def forward(hidden_states):
            logits = logits_fn(gate, hidden_states)
            if ids.shape[0] != logits.shape[0]:
                raise ValueError(f"forced routes for {ids.shape[0]} tokens, the router sees {logits.shape[0]}")
            if own_topk is not None:
                own_topk.append(original(gate, hidden_states)[2].detach())
            return logits, gates_fn(gate, logits, ids), ids
        return forward

    try:
        for gate, ids in zip(gates, per_layer):
            gate.forward = make(gate, ids)
        yield
    finally:
        for gate in gates:
            gate.__dict__.pop("forward", None)


@torch.no_grad()
def forced_logits(hf_model, tokens: torch.Tensor, routes: np.ndarray,
                  position_offset: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """One sample: tokens [T], routes [T, moe_layers, top_k] -> (fp32 logits [T, V], the routers' own top-k
    [T, moe_layers, top_k] under the forced routing).

    position_offset: rotary positions start there. RoPE depends only on relative positions, but its fp32 rounding
    grows with the absolute angle (1.5e-5 at positions 0..59, 7e-5 at 400..459 on the tiny Qwen3-MoE); a sample
    packed behind others is rotated from its offset in the pack, so its reference is too."""
    gates = moe_gates(hf_model)
    check_routes(gates, routes, tokens.shape[0])
    per_layer = [torch.from_numpy(np.asarray(routes)[:, j].astype(np.int64)) for j in range(len(gates))]
    own: list[torch.Tensor] = []
    with forced(gates, per_layer, own):
        pos = torch.arange(position_offset, position_offset + tokens.shape[0])[None]
        logits = hf_model(input_ids=tokens[None], position_ids=pos).logits[0].float()
    return logits, np.stack([o.numpy() for o in own], axis=1)


def reference_model(path: str, dtype: torch.dtype = torch.float32):
    """HF transformers model for the reference (eager attention: the same math as Megatron's local attention)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                             experts_implementation="eager").eval()


def differ_fraction(forced_ids: np.ndarray, own_ids: np.ndarray) -> tuple[int, int]:
    """(forced decisions whose expert is not among the router's own top-k for that token, all forced decisions)."""
    f, o = np.asarray(forced_ids), np.asarray(own_ids)
    hit = (f[..., :, None] == o[..., None, :]).any(-1)
    return int((~hit).sum()), int(hit.size)
