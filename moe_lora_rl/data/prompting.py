"""How a problem becomes prompt ids: the tokenizer's chat template, or a plain template for checkpoints without one
(most base models, the usual start of RL from a base model).

    template = resolve_template(tokenizer, cfg.data.prompt_template, where=model_dir)   # "chat" | "plain"
    ids = encode_prompts(tokenizer, problems, template)

data.prompt_template: chat (the tokenizer's template; refused when it has none), plain (the messages' contents, one
block each, then a newline: no role markers), auto (chat when the tokenizer has a template, else plain, said in the
run's log). check_tokenizer refuses a tokenizer the run cannot use (no end-of-sequence token to stop on) before
anything starts.
"""
from __future__ import annotations


TEMPLATES = ("auto", "chat", "plain")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_template(tokenizer, choice: str, where: str = "the tokenizer") -> str:
    """chat or plain for data.prompt_template=choice; ValueError (one line) if chat is asked of a tokenizer without
    a chat template."""
    if choice not in TEMPLATES:
        raise ValueError(f"data.prompt_template={choice!r}; choose one of {TEMPLATES}")
    if choice == "chat" and not has_chat_template(tokenizer):
        raise ValueError(f"data.prompt_template=chat: the tokenizer of {where} has no chat template; use "
                         "data.prompt_template=plain (or auto)")
    if choice == "auto":
        return "chat" if has_chat_template(tokenizer) else "plain"
    return choice


def check_tokenizer(tokenizer, where: str = "the tokenizer") -> None:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {where} has no eos_token: responses could not stop (set eos_token in "
                         "its tokenizer_config.json)")


def plain_text(problem) -> str:
    return "\n\n".join(m["content"] for m in problem.messages) + "\n"


def encode_prompts(tokenizer, problems: list, template: str = "chat") -> list[list[int]]:
    if template == "plain":                 # no special tokens but a BOS (some tokenizers would append an EOS)
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        return [bos + list(tokenizer(plain_text(p), add_special_tokens=False)["input_ids"]) for p in problems]
    if template != "chat":
        raise ValueError(f"template={template!r}: expected 'chat' or 'plain'")
    out = tokenizer.apply_chat_template([p.messages for p in problems], add_generation_prompt=True, tokenize=True)
    return [list(x) for x in (out["input_ids"] if hasattr(out, "keys") else out)]


def prompt_lengths(tokenizer, problems: list, template: str = "chat") -> list[int]:
    return [len(x) for x in encode_prompts(tokenizer, problems, template)]


def fit_prompt(ids: list[int], max_len: int, truncation: str, where: str) -> list[int]:
    """verl's data.truncation for a prompt over data.max_prompt_length tokens: error (ValueError naming `where`,
    the row), left (its last max_len tokens), right (its first), middle (both ends, the middle left out)."""
    if len(ids) <= max_len:
        return ids
    if truncation == "left":
        return ids[-max_len:]
    if truncation == "right":
        return ids[:max_len]
    if truncation == "middle":
        left = max_len // 2
        return ids[:left] + ids[len(ids) - (max_len - left):]
    raise ValueError(f"{where}: the prompt is {len(ids)} tokens, over data.max_prompt_length={max_len} (raise it, "
                     "set data.filter_overlong_prompts=true, or data.truncation=left/right/middle)")
