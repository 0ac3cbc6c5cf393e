"""An offline byte-level BPE tokenizer, trained on deterministic synthetic text (no hub access needed)."""
from __future__ import annotations

import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = ("the a of to and in is that it for on with as was be by this are or from at which an have not they "
          "but one all were we when there can more if so what about up out who them some could into then than "
          "expert router token layer model train learn reward policy answer question solve number sum step").split()


def synthetic_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Arithmetic problems and word salad: enough structure for a BPE vocabulary of a few hundred merges."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        val = {"+": a + b, "-": a - b, "*": a * b}[op]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
        out.append(f"Question: what is {a} {op} {b}? Answer: {val}. {words.capitalize()}.")
    return out


def train_tokenizer(out_dir: Path, *, vocab_size: int = 512, seed: int = 0, model_max_length: int = 4096):
    """Train, wrap as a transformers fast tokenizer and save into out_dir. Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, model_max_length=model_max_length)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast
