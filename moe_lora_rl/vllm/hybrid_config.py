"""What our vLLM engines do with a hybrid linear-attention checkpoint (Qwen3.5/3.6-MoE, Qwen3-Next: layers with
recurrent conv / SSM state beside the attention KV) before an engine starts (pure: reads config.json, no vLLM import).

    prefix caching   vLLM 0.32 caches a hybrid model's prefixes only in mamba_cache_mode 'align' (the recurrent
                     state kept at block boundaries), which asserts chunked prefill. With chunked prefill on (vLLM's
                     default; make_engine's) it stays as asked: measured exact on the fp32 delta-net path (a 300-token
                     shared prefix, 256 tokens read from the cache, the next request's decode logprobs within 1.6e-5
                     of HF's; tests/e2e/test_hybrid_vllm.py). With chunked prefill off (the rollout loop turns it off,
                     rollout/server.py: a seeded CPU generator cannot rewind after a partial prefill) it is turned off
                     with one line, instead of vLLM's assertion at start; prompts are then prefilled in full (exact).

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


def prefix_caching(model_dir: str | Path, requested: bool | None, *, chunked_prefill: bool | None = None
                   ) -> tuple[bool | None, list[str]]:
    """(the engine's enable_prefix_caching, lines to print): False for a hybrid checkpoint on an engine without
    chunked prefill (chunked_prefill=False), with one line when the caller asked for it or left it to vLLM (whose
    default turns it on); `requested` unchanged otherwise."""
    path = Path(model_dir) / "config.json"
    if requested is False or chunked_prefill is not False or not path.is_file() \
            or not is_hybrid(json.loads(path.read_text())):
        return requested, []
    return False, ["moe_lora: prefix caching off for this hybrid linear-attention checkpoint: vLLM caches its "
                   "recurrent state only with chunked prefill (mamba_cache_mode 'align'), which this engine turns "
                   "off; prompts are prefilled in full (exact)"]
