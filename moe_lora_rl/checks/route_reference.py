"""HF transformers reference for served adapters: the checkpoint with W + scale * B @ A merged (fp64, rounded once
to `dtype`), its router decisions (top-k ids per MoE layer, from each router's own forward) and logits."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch


def random_expert_adapter(arch, rank: int, seed: int, std: float = 0.5,
                          fused_fc1: bool = False) -> dict[str, torch.Tensor]:
    """PEFT tensors on every routed expert's gate/up/down projection; std chosen so the adapter moves routing.
    fused_fc1: up_proj's A is gate_proj's A, as in Megatron's expert LoRA (one A on the fused gate/up linear_fc1),
    so that the adapter is one Megatron's LoRA can hold (refit/import_peft.py)."""
    g = torch.Generator().manual_seed(seed)
    h, i = arch.hidden_size, arch.moe_ffn_hidden_size
    shapes = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    out = {}
    for layer, moe in enumerate(arch.moe_layers):
        if not moe:
            continue
        for e in range(arch.num_experts):
            for proj, (din, dout) in shapes.items():
                p = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                out[f"{p}.lora_A.weight"] = torch.randn(rank, din, generator=g) * std / din ** 0.5
                if fused_fc1 and proj == "up_proj":
                    out[f"{p}.lora_A.weight"] = out[f"{p.replace('up_proj', 'gate_proj')}.lora_A.weight"].clone()
                out[f"{p}.lora_B.weight"] = torch.randn(dout, rank, generator=g) * std / rank ** 0.5
    return out


def merged_hf_model(model_dir: str, peft: dict[str, torch.Tensor] | None, scale: float, dtype=torch.float32,
                    **load_kw):
    """HF transformers with W + scale * B @ A merged; load_kw: more from_pretrained arguments."""
    import transformers
    from safetensors.torch import save_file

    from ..refit.merged import merged_state

    if not peft:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager",
                                                                 **load_kw).eval()
    with tempfile.TemporaryDirectory() as tmp:
        for f in Path(model_dir).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy(f, tmp)
        save_file({k: v.contiguous() for k, v in merged_state(model_dir, peft, scale)}, f"{tmp}/model.safetensors")
        return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="eager",
                                                                 **load_kw).eval()


def choice_margin(logits: torch.Tensor, arch, bias: torch.Tensor | None) -> torch.Tensor:
    """[T] how far each token's top-k decision is from flipping: the gap between the k-th and (k+1)-th selection
    score (softmax probability, or sigmoid score + expert bias), and for group-limited routing also the gap between
    the last kept and the first dropped group. Decisions closer than the serving dtype's rounding are ties."""
    k = arch.topk
    if arch.score_function == "softmax":
        s = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
        return s[:, k - 1] - s[:, k]
    choice = torch.sigmoid(logits.float()) + (bias if bias is not None else 0)
    margin = torch.full((choice.shape[0],), float("inf"))
    if arch.num_groups:
        t, e = choice.shape
        g = choice.view(t, arch.num_groups, e // arch.num_groups).topk(2, dim=-1)[0].sum(-1)
        gs, gi = g.sort(-1, descending=True)
        margin = gs[:, arch.group_topk - 1] - gs[:, arch.group_topk]
        keep = torch.zeros_like(g).scatter_(1, gi[:, :arch.group_topk], 1.0)
        mask = keep.unsqueeze(-1).expand(t, arch.num_groups, e // arch.num_groups).reshape(t, e)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    s = choice.sort(-1, descending=True).values
    return torch.minimum(margin, s[:, k - 1] - s[:, k])


@torch.no_grad()
def hf_routes(model, moe_layers: list[int], seqs: list[list[int]], arch=None):
    """Per sequence [len, len(moe_layers), topk] expert ids (sorted per token) from the HF routers; with arch, also
    per sequence [len, len(moe_layers)] decision margins (choice_margin)."""
    got: dict[int, tuple] = {}
    hooks = [model.model.layers[l].mlp.gate.register_forward_hook(
        lambda m, a, out, l=l: got.__setitem__(l, (out[0], out[2], m))) for l in moe_layers]
    try:
        res, margins = [], []
        for s in seqs:
            got.clear()
            model(input_ids=torch.tensor([s]))
            res.append(np.stack([got[l][1].sort(-1).values.numpy() for l in moe_layers], axis=1))
            if arch is not None:
                margins.append(np.stack([choice_margin(got[l][0], arch, getattr(got[l][2], "e_score_correction_bias",
                                                                                 None)).numpy()
                                         for l in moe_layers], axis=1))
        return (res, margins) if arch is not None else res
    finally:
        for h in hooks:
            h.remove()


def agreement(a: list[np.ndarray], b: list[np.ndarray], per_choice: bool = False,
              margins: list[np.ndarray] | None = None, min_margin: float = 0.0) -> float:
    """Fraction of (token, layer) routing decisions with the same top-k set; per_choice: of (token, layer, expert
    chosen) decisions, i.e. the mean overlap of the two top-k sets; margins: only decisions whose reference margin
    is at least min_margin (not ties)."""
    same = total = 0
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise ValueError(f"route shapes differ: {x.shape} vs {y.shape}")
        if per_choice:
            eq = (x[..., :, None] == y[..., None, :]).any(-1)
        else:
            eq = (np.sort(x, -1) == np.sort(y, -1)).all(-1)
        if margins is not None:
            eq = eq[margins[i] >= min_margin]
        same, total = same + int(eq.sum()), total + eq.size
    return same / total
