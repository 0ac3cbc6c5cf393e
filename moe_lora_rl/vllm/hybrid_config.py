"""What our vLLM engines do with a hybrid linear-attention checkpoint (Qwen3.5/3.6-MoE, Qwen3-Next: layers with
recurrent conv / SSM state beside the attention KV) before an engine starts (pure: reads config.json, no vLLM import).

    prefix caching   off, with one line saying why. vLLM 0.32 caches a hybrid model's prefixes only in
                     mamba_cache_mode 'align' (the recurrent state kept at block boundaries), which asserts chunked
                     prefill, and the rollout loop turns chunked prefill off (rollout/server.py: a seeded CPU generator
                     cannot rewind after a partial prefill; the commit barrier counts a prefill as one step). A cached
                     prefix would also hold state computed under the adapter version that filled it, as attention
                     blocks do: the engine keys blocks by version (cache_salt), which would have to cover the state
                     blocks too. Neither is measured here, so prefixes are recomputed: exact, at the cost of the
                     shared prompt's prefill.

Both ways we start an engine of our own take this through prefix_caching(model_dir, requested): make_engine
(rollout/vllm_engine.py) and so the rollout server and the benches.
"""
from __future__ import annotations

import json
from pathlib import Path

LINEAR = "linear_attention"


def is_hybrid(config: dict) -> bool:
    """Layers with recurrent state: layer_types (or the text tower's) names linear-attention layers."""
    text = config.get("text_config") or {}
    return LINEAR in (config.get("layer_types") or text.get("layer_types") or ())


def prefix_caching(model_dir: str | Path, requested: bool | None) -> tuple[bool | None, list[str]]:
    """(the engine's enable_prefix_caching, lines to print): False for a hybrid checkpoint, with one line when the
    caller asked for it or left it to vLLM (whose default turns it on); `requested` unchanged otherwise."""
    path = Path(model_dir) / "config.json"
    if requested is False or not path.is_file() or not is_hybrid(json.loads(path.read_text())):
        return requested, []
    return False, ["moe_lora: prefix caching off for this hybrid linear-attention checkpoint: vLLM caches its "
                   "recurrent state only with chunked prefill (mamba_cache_mode 'align'), which the rollout loop "
                   "turns off; prompts are prefilled in full (exact)"]
