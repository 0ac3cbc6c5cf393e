"""R3 inside verl from our capture: what our HTTP server puts in verl's `TokenOutput.routed_experts`.

verl's agent loop reads that field as one [tokens, layers, top-k] array per request (it casts to int16 and places it
at the sample's left-padding offset); our trainer engine reads the layer axis as the model's MoE layers in order
(routes.routes_from_verl). Our worker extension's capture (vllm/capture.py) gives exactly those rows: every token the
engine forwarded (prompt and response, the last sampled token never), prefix-cache aware, with an adapter served.
vLLM's own routed-experts return (enable_return_routed_experts) stays off: on CPU it needs Model Runner V2 (Triton).

Every worker rank captures the MoE layers it runs (tensor-parallel ranks the same layers, pipeline stages their own
ones): the ranks' routes are merged by layer number, and two ranks reporting one layer must agree.
"""
from __future__ import annotations

import asyncio

import numpy as np

ROUTE_DTYPE = np.int16                       # verl's dtype for routed_experts (agent_loop casts to it)


def merge_meta(metas: list[dict]) -> dict:
    """The capture meta of every worker rank -> one meta over the union of their MoE layers."""
    if not metas:
        raise RuntimeError("routing capture: no worker answered moe_lora_capture_start")
    layers = sorted({int(l) for m in metas for l in m["layer_ids"]})
    first = metas[0]
    for m in metas[1:]:
        if (m["num_experts"], m["topk"]) != (first["num_experts"], first["topk"]):
            raise RuntimeError(f"routing capture: worker ranks disagree on experts/top-k ({first['num_experts']}, "
                               f"{first['topk']}) vs ({m['num_experts']}, {m['topk']})")
    if first["num_experts"] > np.iinfo(ROUTE_DTYPE).max + 1:
        raise ValueError(f"routing capture: {first['num_experts']} experts do not fit verl's int16 routed_experts")
    return {"layer_ids": layers, "num_experts": int(first["num_experts"]), "topk": int(first["topk"]),
            "rank_layers": [[int(l) for l in m["layer_ids"]] for m in metas]}


def merge_routes(meta: dict, parts: list, request_id: str, n_tokens: int) -> np.ndarray:
    """One popped routes array per worker rank ([n_tokens, rank's layers, topk]) -> verl's [n_tokens, MoE layers,
    topk] int16. n_tokens: the tokens the engine forwarded (prompt + response - 1)."""
    cols: dict[int, np.ndarray] = {}
    for rank, (layers, part) in enumerate(zip(meta["rank_layers"], parts)):
        r = part.get(request_id) if isinstance(part, dict) else None
        if r is None:
            raise RuntimeError(f"routing capture: worker rank {rank} has no routes for request {request_id!r}")
        r = from_wire(r)
        if r.shape != (n_tokens, len(layers), meta["topk"]):
            raise RuntimeError(f"routing capture: request {request_id!r} routes of shape {tuple(r.shape)} on worker "
                               f"rank {rank}, expected {(n_tokens, len(layers), meta['topk'])}")
        for j, layer in enumerate(layers):
            if layer in cols and not np.array_equal(cols[layer], r[:, j]):
                raise RuntimeError(f"routing capture: worker ranks disagree on the routes of layer {layer} for "
                                   f"request {request_id!r}")
            cols.setdefault(layer, r[:, j])
    return np.stack([cols[l] for l in meta["layer_ids"]], axis=1).astype(ROUTE_DTYPE)


def from_wire(r) -> np.ndarray:
    """[dtype, shape, bytes] (the worker extension's moe_lora_capture_pop(wire=True)) -> the array."""
    if isinstance(r, np.ndarray):
        return r
    dtype, shape, data = r
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(tuple(shape))


class ServerRoutes:
    """Capture on the server's AsyncLLM: started once (before the first request), popped per request id."""

    def __init__(self):
        self.meta: dict | None = None
        self._lock = asyncio.Lock()

    async def start(self, engine) -> dict:
        async with self._lock:
            if self.meta is None:
                self.meta = merge_meta(await engine.collective_rpc("moe_lora_capture_start"))
        return self.meta

    async def pop(self, engine, request_id: str, n_tokens: int) -> np.ndarray:
        parts = await engine.collective_rpc("moe_lora_capture_pop", args=([request_id], True))
        return merge_routes(self.meta, parts, request_id, n_tokens)

    async def discard(self, engine, request_id: str) -> None:
        """An aborted or failed request: its partial routes are dropped (a resubmitted id starts clean)."""
        await engine.collective_rpc("moe_lora_capture_discard", args=([request_id],))
