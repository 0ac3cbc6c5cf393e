"""Rollouts on a compressed KV cache (Sparse-RL's sparse sampler): the methods the engine offers, their checks, and
how the engine is built with one.

    check_compression("window", budget=32, max_model_len=512, model_config=cfg_json)   # ValueError, one line
    llm_kw = engine_kwargs("window", 32, cfg_json)         # -> make_engine(**llm_kw)
    verify(llm, "window", 32)                              # the built engine's KV cache really is windowed
    evictor = install_method(llm, "snapkv", 96, {"recent": 32})    # importance eviction on the built engine

snapkv: importance-based eviction (vllm/kv_select.py decides, vllm/kv_evict.py moves): a sequence keeps `budget`
tokens, the first `sinks`, the last `recent` and, per KV head, those its last `window` queries attend to most,
compressed every `interval` steps; the kept tokens are compacted into the sequence's first blocks and the blocks
between go back to vLLM's pool. Its settings besides the budget come as `evict` ({sinks, recent, window, interval,
pool}; kv_select.EvictPolicy's defaults otherwise). It needs prefix caching off (compaction rewrites blocks in
place).

window: vLLM's sliding-window attention on every layer (each token attends to the last `budget` tokens, itself
included) with its sliding-window KV manager, which frees every block that falls wholly outside the window: the
blocks a sequence holds stop growing at about budget / block_size + 1, whatever its length. It is chosen because
vLLM's paged cache frees blocks whole and has no token-level eviction by importance (SnapKV, R-KV): an
importance-based method would need compaction of kept tokens into fresh blocks, attention over a per-request
gather of kept positions, and a trainer-side reference of the same selection, none of which the CPU build offers.
The prompt is windowed too (its last tokens are what the first response token sees).
"""
from __future__ import annotations

METHODS = ("none", "window", "snapkv")
MIN_BUDGET = {"window": 8, "snapkv": 1}   # tokens: a window shorter than a trace line cannot continue one; snapkv's
#                                           floor is its policy's (sinks + recent)


def policy(budget: int, evict: dict | None):
    """snapkv's EvictPolicy from the budget and the evict settings (ValueError naming an unknown key)."""
    from ..vllm.kv_select import EvictPolicy

    fields = ("sinks", "recent", "window", "interval", "pool")
    if evict is not None and not hasattr(evict, "keys"):
        raise ValueError(f"rollout.kv_evict={evict!r} is not a mapping of {list(fields)}")
    unknown = sorted(set(evict or {}) - set(fields))
    if unknown:
        raise ValueError(f"rollout.kv_evict: unknown setting(s) {unknown}; expected some of {list(fields)}")
    return EvictPolicy(budget=budget, **dict(evict or {}))


def check_compression(method: str, budget: int, max_model_len: int, model_config: dict | None = None,
                      evict: dict | None = None) -> None:
    """One-line ValueError for a method, budget or model the engine cannot compress with."""
    if method not in METHODS:
        raise ValueError(f"rollout.kv_compression={method!r} is not one of {METHODS}")
    if evict and method != "snapkv":
        raise ValueError(f"rollout.kv_evict={dict(evict)} applies to kv_compression=snapkv, not {method!r}")
    if method == "none":
        if budget:
            raise ValueError(f"rollout.kv_budget={budget} needs rollout.kv_compression (it is 'none')")
        return
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_BUDGET[method]:
        raise ValueError(f"rollout.kv_budget={budget!r} is below {method}'s minimum of {MIN_BUDGET[method]} tokens")
    if method == "snapkv":
        policy(budget, evict)
    if budget > max_model_len:
        raise ValueError(f"rollout.kv_budget={budget} exceeds the engine's max_model_len {max_model_len}")
    cfg = model_config or {}
    if cfg.get("kv_lora_rank"):
        raise ValueError(f"rollout.kv_compression={method}: the model's attention is MLA (kv_lora_rank="
                         f"{cfg['kv_lora_rank']}), which the engine cannot compress")
    if method == "snapkv" and (cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or [])):
        raise ValueError("rollout.kv_compression=snapkv: the model has sliding-window attention layers, which "
                         "importance eviction does not handle")
    types = cfg.get("layer_types")
    if types and any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ValueError(f"rollout.kv_compression={method}: the model has non-attention layers "
                         f"({sorted(set(types))}); only attention layers can be windowed")


def engine_kwargs(method: str, budget: int, model_config: dict | None = None) -> dict:
    """make_engine keyword arguments for the method ({} for none and snapkv, which is installed on the built engine:
    install_method): hf_overrides that window every layer."""
    if method in ("none", "snapkv"):
        return {}
    over = {"sliding_window": budget, "use_sliding_window": True, "max_window_layers": 0}
    n = (model_config or {}).get("num_hidden_layers")
    if (model_config or {}).get("layer_types") is not None and n:
        over["layer_types"] = ["sliding_attention"] * n
    return {"hf_overrides": over}


def verify(llm, method: str, budget: int) -> dict:
    """The engine's KV layout (kv_meter.kv_layout); RuntimeError when it is not what the method asked for (a model
    whose vLLM implementation ignores the window would otherwise sample densely and be reported as sparse)."""
    from .kv_meter import kv_layout

    layout = kv_layout(llm)
    want = budget if method == "window" else None
    if layout["sliding_window"] != want:
        raise RuntimeError(f"kv_compression={method} budget={budget}: the engine's KV cache has sliding_window="
                           f"{layout['sliding_window']}, expected {want}")
    return layout


def install_method(llm, method: str, budget: int, evict: dict | None = None, keep_events: bool = False):
    """snapkv: the evictor installed on the built engine (vllm/kv_evict.py; it refuses an engine with prefix
    caching on); None for the other methods. keep_events: it logs each request's compressions (KV replay)."""
    if method != "snapkv":
        return None
    from ..vllm.kv_evict import install

    return install(llm, policy(budget, evict), keep_events)
