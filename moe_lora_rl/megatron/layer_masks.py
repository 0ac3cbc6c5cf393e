"""Per-layer attention masks for one forward (KV replay: policy/kv_masks.py builds them), scoped:

    with layer_masks(model, {layer: bool [b, heads on this rank, s, s] (True = masked)}):
        model(input_ids=..., position_ids=..., attention_mask=...)

Each decoder layer's core attention gets its own mask (by the layer's global index, so any pipeline stage works)
instead of the one the model was called with. The local attention path only (DotProductAttention: its softmax
fills masked scores and takes a mask per head); the Transformer Engine path takes another mask format and is refused.
masks None or empty: nothing is hooked.
"""
from __future__ import annotations

import contextlib

import torch


def _core_attentions(model) -> dict[int, torch.nn.Module]:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    out = {}
    for m in model.modules():
        if isinstance(m, TransformerLayer):
            out[m.layer_number - 1] = m.self_attention.core_attention
    return out


@contextlib.contextmanager
def layer_masks(model, masks: dict[int, torch.Tensor] | None):
    if not masks:
        yield
        return
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cores = _core_attentions(model)
    handles = []
    try:
        for li, core in cores.items():
            if not isinstance(core, DotProductAttention):
                raise ValueError(f"kv replay needs the local attention path (runtime.layer_spec=local): layer {li} "
                                 f"attends with {type(core).__name__}")
            if li not in masks:
                raise ValueError(f"kv replay: no mask for layer {li} (masks for layers {sorted(masks)})")
            heads = core.num_attention_heads_per_partition
            if masks[li].shape[1] != heads:
                raise ValueError(f"kv replay: layer {li}'s mask has {masks[li].shape[1]} heads, its attention "
                                 f"{heads} on this rank")

            def pre(module, args, kwargs, mask=masks[li]):
                mask = mask.to(args[0].device)
                if "attention_mask" in kwargs:
                    kwargs["attention_mask"] = mask
                    return args, kwargs
                return (*args[:3], mask, *args[4:]), kwargs
            handles.append(core.register_forward_pre_hook(pre, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
