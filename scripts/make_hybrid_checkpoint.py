"""A Qwen3.5-MoE checkpoint built with transformers directly (not the project's model factory), in a layer pattern of
your choosing: what `python -m moe_lora_rl.bench parity|lora|serve --model DIR` is run on to show the family is read
from its config.json, not from the factory's defaults.

    python scripts/make_hybrid_checkpoint.py OUT_DIR [--pattern LFLLF] [--seed 0]

--pattern: one letter per layer, L = linear_attention (Gated DeltaNet), F = full_attention (default LFFLL: two full
layers, first and last linear, not Qwen3.5's 3:1). Sizes: hidden 128, 4 heads / 2 KV of 32, delta-net 2 key / 4
value heads of 32, 8 experts top-2, a gated shared expert, vocab 512, fp32. transformers' own initialisation at
std 0.1 (logits up to ~5; at its default 0.02 they are ~1e-2), except dt_bias, drawn as Mamba's (softplus(dt_bias)
log-uniform on [1e-3, 0.1]): transformers' dt_bias = 1 makes the per-token decays reach -44, where the chunked delta
rule loses fp32's precision (models/tiny_hybrid.py).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def build(out: Path, pattern: str, seed: int) -> Path:
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    kinds = {"L": "linear_attention", "F": "full_attention"}
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=len(pattern), layer_types=[kinds[c] for c in pattern],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=False, eos_token_id=2,
        pad_token_id=0, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            gdn = getattr(layer, "linear_attn", None)
            if gdn is not None:
                lo, hi = math.log(1e-3), math.log(0.1)
                dt = torch.exp(torch.rand_like(gdn.dt_bias) * (hi - lo) + lo)
                gdn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))          # softplus^-1(dt)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/make_hybrid_checkpoint.py")
    ap.add_argument("out")
    ap.add_argument("--pattern", default="LFFLL", help="one letter per layer: L linear_attention, F full_attention")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not a.pattern or set(a.pattern) - {"L", "F"}:
        print(f"make_hybrid_checkpoint.py: error: --pattern {a.pattern!r}: letters L and F only", file=sys.stderr)
        return 2
    out = build(Path(a.out), a.pattern, a.seed)
    print(json.dumps({"out": str(out), "layer_types": json.loads((out / "config.json").read_text())["layer_types"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
