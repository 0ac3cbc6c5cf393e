"""The importance-evicting sampler is what we think it is: an in-process vLLM CPU engine (fp32) with SnapKV-style
eviction (vllm/kv_evict.py), an expert adapter served and routing capture on, against HF transformers with the
same adapter merged and, per layer and KV head, an attention mask that lets each query see exactly the tokens the
engine held when it computed that query (its log of every compression). Controls: the dense mask, and the same
masks with one kept token of one compression swapped for one the engine evicted, must not match. The selection
itself is recomputed from HF's own queries and keys (kv_select.scores on the held tokens) and compared.

    python -m kit.sparse_evict --model DIR [--budget 48 --recent 16 ...] : prints "RESULT <json>"
"""
from __future__ import annotations

import argparse
import json

from moe_lora_rl.policy.kv_masks import visible
from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env


def hf_logprobs(hf, tokens: list[int], n_prompt: int, masks, qk: dict | None = None) -> list[float]:
    """Response logprobs of HF with each layer's attention given its own per-head mask (eager attention). qk: filled
    with each layer's RoPE'd queries [heads, n, d] and keys [kv_heads, n, d], as its attention received them."""
    import torch
    from transformers import AttentionInterface
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    def keep_qk(module, query, key, value, attention_mask, **kw):
        if qk is not None:
            qk[module.layer_idx] = (query[0].detach(), key[0].detach())
        return glm.eager_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("moe_lora_keep_qk", keep_qk)
    impl, hf.config._attn_implementation = hf.config._attn_implementation, "moe_lora_keep_qk"

    attn = [layer.self_attn for layer in hf.model.layers]
    groups = attn[0].num_key_value_groups
    handles = []
    for li, mod in enumerate(attn):
        add = torch.zeros(masks[li].shape, dtype=torch.float32).masked_fill(~masks[li], float("-inf"))
        add = add.repeat_interleave(groups, 0)[None]                 # [1, heads, n, n]

        def pre(module, args, kwargs, add=add):
            kwargs["attention_mask"] = add
            return args, kwargs
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
        hf.config._attn_implementation = impl
    lp = torch.log_softmax(logits, -1)
    return [lp[t - 1, tokens[t]].item() for t in range(n_prompt, len(tokens))]


def reselect(events, masks, qk: dict, pol, scale: float, lag: int = 0) -> tuple[int, int]:
    """(positions the engine kept that the same selection on HF's queries and keys also keeps, positions kept):
    at each compression (seq_len s), per layer, the tokens held for query s - 1 scored by the last `window` queries
    (lag > 0, the control: the window ending `lag` queries earlier)."""
    import torch

    from moe_lora_rl.vllm.kv_select import scores, select

    same = total = 0
    for s, kept in events:
        for li, (q, k) in qk.items():
            held = masks[li][:, s - 1]                                       # [kv_heads, n]
            kvh = held.shape[0]
            pos = torch.stack([torch.nonzero(held[h])[:, 0] for h in range(kvh)])
            keys = torch.stack([k[h, pos[h]] for h in range(kvh)])
            q_pos = torch.arange(s - pol.window - lag, s - lag)
            mine = select(scores(q[:, q_pos].transpose(0, 1), q_pos, keys, pos, scale), pos, pol, s)
            theirs = torch.tensor(kept[li])
            same += sum(len(set(mine[h].tolist()) & set(theirs[h].tolist())) for h in range(kvh))
            total += theirs.numel()
    return same, total


def evicted_swap(events, recent: int, sinks: int):
    """(event 0, layer 0, head 0, a chosen kept position, a candidate the engine evicted) for the control."""
    s, kept = events[0]
    keep = set(kept[0][0])
    old = next(p for p in kept[0][0] if p >= sinks)
    new = next(p for p in range(sinks, s - recent) if p not in keep)
    return (0, 0, 0, old, new)


def main(argv=None) -> dict:
    set_engine_env()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", type=int, default=48)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--recent", type=int, default=16)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--pool", type=int, default=7)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=88)
    a = ap.parse_args(argv)
    import numpy as np

    from moe_lora_rl.vllm.kv_evict import install
    from moe_lora_rl.vllm.kv_select import EvictPolicy
    from moe_lora_rl.checks.route_reference import merged_hf_model
    from .sparse_sampler import ALPHA, RANK, sample_with_adapter

    pol = EvictPolicy(budget=a.budget, sinks=a.sinks, recent=a.recent, window=a.window, interval=a.interval,
                      pool=a.pool)
    llm = make_engine(a.model, dtype="float32", prefix_caching=False, block_size=32, max_model_len=256)
    ev = install(llm, pol, keep_events=True)
    run = sample_with_adapter(llm, a.model, a.requests, a.max_tokens)
    peft, gens = run["peft"], run["gens"]
    hf = merged_hf_model(a.model, peft, ALPHA / RANK, experts_implementation="eager")
    cfg = hf.config
    layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    diffs = {"same": 0.0, "dense": 0.0, "swapped": 0.0}
    n_events, agree, agree_lag = [], [0, 0], [0, 0]
    for g in gens:
        rid = next(k for k in ev.events if k == g.request_id or k.startswith(f"{g.request_id}-"))
        events = ev.events[rid]
        n_events.append(len(events))
        n = len(g.tokens)
        got = np.array(g.logprobs)
        swap = evicted_swap(events, a.recent, a.sinks)
        record = {"recent": a.recent, "events": events}
        for name, masks in (("same", visible(n, record, layers, kvh)), ("dense", visible(n, None, layers, kvh)),
                            ("swapped", visible(n, record, layers, kvh, swap))):
            qk = {} if name == "same" else None
            want = np.array(hf_logprobs(hf, g.tokens, len(g.prompt), masks, qk))
            diffs[name] = max(diffs[name], float(np.abs(got - want).max()))
            if qk:
                scale = hf.model.layers[0].self_attn.scaling
                for acc, lag in ((agree, 0), (agree_lag, 1)):
                    same, total = reselect(events, masks, qk, pol, scale, lag)
                    acc[0] += same
                    acc[1] += total
    res = {"policy": pol.__dict__, "stats": ev.stats(), "events_per_seq": n_events,
           "seq_lens": [len(g.tokens) for g in gens], "logprob_max_diff": diffs,
           "selection_agree": agree[0] / agree[1], "selection_kept": agree[1],
           "selection_agree_lagged": agree_lag[0] / agree_lag[1],
           "routes_shapes": [list(g.routes.shape) for g in gens]}
    print("RESULT " + json.dumps(res))
    return res


if __name__ == "__main__":
    main()
