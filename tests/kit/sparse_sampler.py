"""The sparse sampler is what we think it is: an in-process vLLM CPU engine (fp32) sampling on a windowed KV cache
(rollout/kv_compression.py) with an expert adapter served and routing capture on, against HF transformers with the
same adapter merged and the same windowed attention as an explicit mask (each token attends to the last `window`
tokens, itself included). Controls: the dense mask and windows one shorter and longer must not match; an engine
whose window covers every sequence must match the dense mask. Used by tests/e2e/test_sparse_rollout.py.

    python -m kit.sparse_sampler --model DIR --window 32 [--dense] : prints "RESULT <json>"
"""
from __future__ import annotations

import argparse
import json

from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env

RANK, ALPHA = 4, 8.0


def hf_response_logprobs(hf, tokens: list[int], n_prompt: int, window: int | None) -> list[float]:
    import torch

    from moe_lora_rl.data.warm_start import window_mask

    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=window_mask(len(tokens), window)).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[t - 1, tokens[t]].item() for t in range(n_prompt, len(tokens))]


def sample_with_adapter(llm, model: str, requests: int, max_tokens: int) -> dict:
    """On an in-process fp32 engine: routing capture on, a random expert adapter pushed, `requests` held-out
    sort_trace prompts sampled at temperature 1 with every answer forced to `max_tokens` -> {"peft", "meta",
    "prompts", "params", "gens"} (captured_generate raises unless every route is complete)."""
    import transformers
    from vllm import SamplingParams

    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.transfer.transports import InprocTransport
    from moe_lora_rl.data.hf_sampling import prompt_ids
    from moe_lora_rl.data.task import TaskSpec, make_split
    from moe_lora_rl.rollout.generate import captured_generate, start_capture
    from moe_lora_rl.checks.route_reference import random_expert_adapter

    meta = start_capture(llm)
    peft = random_expert_adapter(load_arch(model), RANK, seed=0, std=0.5, fused_fc1=True)
    InprocTransport(llm).push(1, peft, RANK, ALPHA)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    prompts = prompt_ids(tok, make_split(TaskSpec(length=10, kind="sort_trace"), "eval")[:requests])
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, logprobs=0, ignore_eos=True,
                             detokenize=False) for i in range(len(prompts))]
    return {"peft": peft, "meta": meta, "prompts": prompts, "params": params,
            "gens": captured_generate(llm, prompts, params, meta)}


def main(argv=None) -> dict:
    set_engine_env()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--window", type=int, required=True, help="the engine's KV budget (window length, tokens)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=72)
    a = ap.parse_args(argv)
    import numpy as np

    from moe_lora_rl.rollout.generate import captured_generate, start_capture
    from moe_lora_rl.rollout.kv_compression import engine_kwargs, verify
    from moe_lora_rl.checks.route_reference import merged_hf_model

    cfg = json.loads(open(f"{a.model}/config.json").read())
    llm = make_engine(a.model, dtype="float32", prefix_caching=True, max_model_len=256,
                      **engine_kwargs("window", a.window, cfg))
    layout = verify(llm, "window", a.window)
    run = sample_with_adapter(llm, a.model, a.requests, a.max_tokens)
    peft, meta, gens = run["peft"], run["meta"], run["gens"]
    gens += captured_generate(llm, run["prompts"][:1], run["params"][:1], meta)  # a prefix-cache hit, windowed
    hf = merged_hf_model(a.model, peft, ALPHA / RANK, experts_implementation="eager")
    windows = {"same": a.window, "dense": None, "shorter": a.window - 1, "longer": a.window + 1}
    diffs = {k: 0.0 for k in windows}
    for g in gens:
        got = np.array(g.logprobs)
        for k, w in windows.items():
            want = np.array(hf_response_logprobs(hf, g.tokens, len(g.prompt), w))
            diffs[k] = max(diffs[k], float(np.abs(got - want).max()))
    res = {"window": a.window, "layout": layout, "seq_lens": [len(g.tokens) for g in gens],
           "logprob_max_diff": diffs, "routes_shapes": [list(g.routes.shape) for g in gens],
           "prefix_route_hits": start_capture(llm).get("prefix_route_hits"),
           "repeat_equal": gens[-1].response == gens[0].response}
    print("RESULT " + json.dumps(res))
    return res


if __name__ == "__main__":
    main()
