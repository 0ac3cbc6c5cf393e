"""The one captured generate: `generate -> capture_pop by request id -> checks -> pad` on an engine from make_engine.

    with capturing(llm) as meta:                     # or meta = start_capture(llm), left on (the engine process)
        gens = captured_generate(llm, prompts, params, meta, pad=True)
    gens[i].response, gens[i].logprobs, gens[i].prompt_logprobs, gens[i].routes

Routes are the worker extension's capture of a request: [prompt + response - 1, n_moe_layers, topk] logical expert
ids (the last sampled token is never forwarded); pad=True appends a padding row for it (spread over the experts:
no loss depends on it). A request whose routes, logprobs or prompt logprobs are not complete fails the whole call
(RuntimeError), never an output without them.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np


@dataclass
class Generated:
    request_id: str
    prompt: list[int]
    response: list[int]
    finish_reason: str
    logprobs: list[float] | None            # per response token (params.logprobs set): the sampled token's
    prompt_logprobs: list[float] | None     # per prompt token 1.. (params.prompt_logprobs set)
    routes: np.ndarray | None               # capture on: [len(prompt) + len(response) - 1 (+1 if pad), layers, topk]
    versions: list | None = None            # engine loop: the adapter version that produced each response token
    kv_kept: dict | None = None             # KV replay: the eviction record (the tokens each query saw)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response


def start_capture(llm) -> dict:
    """Start routing capture, or, when it runs, read its meta and counters (layer_ids, topk, prefix_route_hits)."""
    return llm.collective_rpc("moe_lora_capture_start")[0]


def stop_capture(llm) -> None:
    """Stop routing capture: drops the routes not popped yet and the prefix route store."""
    llm.collective_rpc("moe_lora_capture_stop")


@contextmanager
def capturing(llm):
    """Routing capture on for the block (its meta is the value), off after it."""
    try:
        yield start_capture(llm)
    finally:
        stop_capture(llm)


def captured_generate(llm, prompts: list[list[int]], params, meta: dict | None = None, *,
                      pad: bool = False) -> list[Generated]:
    """One request per prompt (params: one SamplingParams or one per prompt), results in order. meta: that of the
    running capture (start_capture); None: capture off, routes None. When the routes cannot be popped, the capture
    is restarted (dropping what this call left in it) and the call raises RuntimeError."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if len(outs) != len(prompts):
        raise RuntimeError(f"{len(outs)} outputs for {len(prompts)} prompts")
    routes = {}
    if meta is not None:
        try:
            routes = llm.collective_rpc("moe_lora_capture_pop", args=([o.request_id for o in outs],))[0]
        except Exception as e:
            stop_capture(llm)
            start_capture(llm)
            raise RuntimeError(f"routing capture: {e}") from e
    per = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    return [_checked(p, sp, o, routes.get(o.request_id), meta, pad) for p, sp, o in zip(prompts, per, outs)]


def _checked(prompt, sp, out, routes, meta, pad: bool) -> Generated:
    c = out.outputs[0]
    resp = list(c.token_ids)
    lps = None
    if sp.logprobs is not None:
        lps = [d[t].logprob for t, d in zip(resp, c.logprobs or [])]
    return finish_generated(out.request_id, prompt, sp, resp, lps, out.prompt_logprobs, str(c.finish_reason),
                            routes, meta, pad)


def finish_generated(request_id: str, prompt, sp, resp: list[int], lps, prompt_lps, finish_reason: str, routes,
                     meta, pad: bool) -> Generated:
    """The checks of a finished request (logprobs, prompt logprobs and routes complete) -> Generated."""
    plps = None
    if sp.logprobs is not None:
        lps = lps or []
        if len(lps) != len(resp):
            raise RuntimeError(f"request {request_id}: {len(lps)} logprobs for {len(resp)} response tokens")
    else:
        lps = None
    if sp.prompt_logprobs is not None:
        if len(prompt_lps or []) != len(prompt):
            raise RuntimeError(f"request {request_id}: {len(prompt_lps or [])} prompt logprobs for "
                               f"{len(prompt)} prompt tokens")
        plps = [prompt_lps[t][prompt[t]].logprob for t in range(1, len(prompt))]
    if meta is not None:
        want = (len(prompt) + len(resp) - 1, len(meta["layer_ids"]), meta["topk"])
        if routes is None or tuple(routes.shape) != want:
            raise RuntimeError(f"incomplete routes for request {request_id}: shape "
                               f"{None if routes is None else tuple(routes.shape)}, expected {want}")
        if pad:
            from ..router_replay.align import spread_pad

            last = np.broadcast_to(spread_pad(1, meta["topk"], meta["num_experts"]), (1, *want[1:]))
            routes = np.concatenate([routes, last.astype(routes.dtype)])
    return Generated(request_id, list(prompt), resp, finish_reason, lps, plps, routes)
