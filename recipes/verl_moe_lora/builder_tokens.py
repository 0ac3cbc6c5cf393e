"""A copy of a model whose tokenizer has the turn tokens verl's agent loop requires of the model's family.

verl's agent loop tokenizes each rollout with the Continuous Token builder its `model_type` selects
(verl/utils/tokenizer/continuous_token_wiring.py); the GLM-4.7 and DeepSeek builders look up their family's special
tokens and refuse a tokenizer without them. The tiny models' offline tokenizer (ChatML turns) has none, so the CPU
recipes serve a copy whose tokenizer has them as added special tokens (ids past the model's vocab: never prompted,
never sampled); the model's other files are links.

    python recipes/verl_moe_lora/builder_tokens.py MODEL_DIR OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

# model_type -> the tokens verl's builder for it requires (verl 0.9.1: GLM47ContinuousTokenBuilder,
# DeepSeekContinuousTokenBuilder); model types not listed need none
BUILDER_TOKENS = {
    "glm4_moe": ("<|user|>", "<|observation|>"),
    "deepseek_v3": ("<\uff5cend\u2581of\u2581sentence\uff5c>",),
}


def copy_with_builder_tokens(model: Path, out: Path) -> tuple[str, ...]:
    """Link model's files into out, with a tokenizer that has BUILDER_TOKENS[model_type] added; returns them."""
    out.mkdir(parents=True, exist_ok=True)
    tokens = BUILDER_TOKENS.get(json.loads((model / "config.json").read_text()).get("model_type"), ())
    if tokens:                           # the tokenizer's files first: links never written through
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        tok.add_special_tokens({"additional_special_tokens": list(tokens)})
        tok.save_pretrained(out)
    for f in model.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    return tokens


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: builder_tokens.py MODEL_DIR OUT_DIR")
    copy_with_builder_tokens(Path(sys.argv[1]), Path(sys.argv[2]))
