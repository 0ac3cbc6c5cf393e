"""Batches with the expert-load shapes that break naive expert LoRA: an expert with an odd token count and an
expert with no token at all, in the same MoE layer (measured with HF transformers' routers)."""
from __future__ import annotations

import torch


@torch.no_grad()
def expert_token_counts(hf_model, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """Tokens routed to each expert, per MoE layer index, from the HF routers' top-k indices."""
    counts: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf_model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "weight") or gate.weight.dim() != 2 or not hasattr(layer.mlp, "experts"):
            continue
        n = gate.weight.shape[0]

        def hook(mod, inp, out, i=i, n=n):
            counts[i] = torch.bincount(out[-1].reshape(-1), minlength=n)
        hooks.append(gate.register_forward_hook(hook))
    try:
        hf_model(input_ids=tokens)
    finally:
        for h in hooks:
            h.remove()
    return counts


def uneven_batch(hf_model, n: int, s: int, vocab: int, seed: int = 0, tries: int = 200) -> tuple[torch.Tensor, dict]:
    """A [n, s] batch where some MoE layer has an expert with zero tokens and an expert with an odd count.
    Tokens come from a small random sub-vocabulary, which concentrates routing. A model whose routers spread every
    such batch (no empty expert in `tries`) gets the batch with the least-loaded expert and an odd count, and
    "empty": False says so (the layout comparison still runs; a test that needs the empty expert asserts on it)."""
    best, best_key = None, None
    for t in range(tries):
        g = torch.Generator().manual_seed(seed * 100003 + t)
        sub = torch.randperm(vocab, generator=g)[: 4 + t % 12]
        toks = sub[torch.randint(0, len(sub), (n, s), generator=g)]
        counts = expert_token_counts(hf_model, toks)
        for layer, c in counts.items():
            if (c == 0).any() and (c % 2 == 1).any():
                return toks, {"layer": layer, "counts": c.tolist(), "try": t, "empty": True}
            key = (bool((c % 2 == 1).any()), -int(c.min()))
            if best_key is None or key > best_key:
                best, best_key = (toks, {"layer": layer, "counts": c.tolist(), "try": t, "empty": False}), key
    if best is None:
        raise ValueError("the model has no MoE layer with an HF router to measure expert loads on")
    return best
