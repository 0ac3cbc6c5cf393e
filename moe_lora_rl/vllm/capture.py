"""Routing capture in vLLM for router replay (R3): per request, the top-k logical expert ids of every token the
engine forwards (prompt and generated; the last sampled token is never forwarded) for every MoE layer.

vLLM's own routed-experts output needs Model Runner V2 (Triton), so on CPU we bind BaseRouter.set_capture_fn
(ids are logical: captured before the EPLB mapping) and listen on the runner's forwards (step_hooks.py) to
split each step's ids by request (query_start_loc). Whatever computes the routing reports through the router's
capture_fn: vLLM's router when vLLM's MoE kernel runs (base model, merged adapters), our plain-torch router when
the adapter runs unmerged (runtime.py). Stored compactly (uint8 for <= 256 experts, else uint16) and freed when
popped.

Completeness is checked per step: every MoE layer must report, and each request's rows must continue at the
position the step starts from. A request with a gap (a layer that did not report, token rows never forwarded, e.g.
prompt tokens served from the prefix cache without their routes) is an error when popped, naming the request,
the missing layers and the missing rows. With prefix caching on, routes of full prompt blocks are kept per block
hash and cache salt, i.e. adapter version (prefix_routes.py), and fill the rows of cached tokens.
"""
from __future__ import annotations


import numpy as np
import torch

from ..models.naming import layer_of
from ..router_replay.routes import compact_dtype
from .step_hooks import StepInfo, add_listener, remove_listener


def find_routers(model) -> list[tuple[int, object]]:
    """(global layer, router) for every MoE router with a capture hook, in layer order.

    ValueError when two routers carry the same layer number (an MTP or draft layer numbered like a decoder layer,
    e.g. `mtp.layers.0` beside `model.layers.0`): one would overwrite the other's routes, and the trainer would
    replay the wrong layer's. MTP layers are not captured or replayed here: RL trains the decoder (models/checkpoint.py
    sets MTP tensors aside)."""
    routers, names = [], {}
    for name, mod in model.named_modules():
        router = getattr(mod, "router", None)
        layer = layer_of(name)
        if router is not None and hasattr(router, "set_capture_fn") and layer is not None:
            if layer in names:
                raise ValueError(f"routing capture: modules {names[layer]!r} and {name!r} both are MoE layer {layer}; "
                                 "an MTP or draft layer numbered like a decoder layer would overwrite its routes")
            names[layer] = name
            routers.append((layer, router))
    return sorted(routers, key=lambda x: x[0])


class RouteCapture:
    def __init__(self, runner, salt_of=None):
        """salt_of: internal request id -> its cache salt (prefix_routes.py; the worker extension asks the LoRA
        runtime)."""
        cfg = runner.vllm_config
        if cfg.compilation_config.mode not in (0, None) and not cfg.model_config.enforce_eager:
            raise ValueError("routing capture needs enforce_eager=True (compiled graphs drop the capture hook)")
        if getattr(cfg, "speculative_config", None) is not None:
            raise ValueError("routing capture with speculative decoding: the target model's forwards verify draft "
                             "tokens that may be rejected, and the draft's routers are another model's; turn "
                             "speculative decoding off while R3 captures routes")
        self.runner = runner
        self.routers = find_routers(runner.model)
        if not self.routers:
            raise ValueError("no MoE router with a capture hook found in the served model")
        self.layer_ids = [l for l, _ in self.routers]
        r0 = self.routers[0][1]
        self.num_experts, self.topk = int(r0.global_num_experts), int(r0.top_k)
        self.dtype = compact_dtype(self.num_experts)
        self.prefix = None
        if cfg.cache_config.enable_prefix_caching:
            from .prefix_routes import PrefixRoutes

            self.prefix = PrefixRoutes(runner, salt_of=salt_of)
        self.step: dict[int, torch.Tensor] = {}
        self.per_request: dict[str, list[np.ndarray]] = {}
        self.rows: dict[str, int] = {}                        # rows captured so far per request
        self.missing_layers: dict[str, set[int]] = {}
        self.missing_rows: dict[str, list[tuple[int, int]]] = {}

    def _record(self, layer: int, ids: torch.Tensor) -> None:
        self.step[layer] = ids.detach().to("cpu")

    def start(self) -> None:
        for layer, router in self.routers:
            router.set_capture_fn(lambda ids, layer=layer: self._record(layer, ids))
        add_listener(self.runner, self)

    # step listener (step_hooks.py): the routes reported during one forward, split by request after it
    def before(self, info: StepInfo) -> None:
        self.step.clear()

    def after(self, info: StepInfo) -> None:
        if not info.failed:
            self._split(info.req_ids, info.query_start_loc, info.num_computed_tokens)
        self.step.clear()

    def _split(self, req_ids, qsl, starts) -> None:
        n_tok = int(qsl[-1])
        got = [l for l in self.layer_ids if l in self.step and self.step[l].shape[0] >= n_tok]
        missing = sorted(set(self.layer_ids) - set(got))
        ids = None
        if not missing:
            ids = np.stack([self.step[l][:n_tok].numpy() for l in self.layer_ids], axis=1).astype(self.dtype)
        # requests continuing where they stopped first: a prompt computed in this step can serve, from the store,
        # the requests of the same step that hit its blocks in the prefix cache
        order = sorted(range(len(req_ids)), key=lambda i: int(starts[i]) != self.rows.get(req_ids[i], 0))
        for i in order:
            rid = req_ids[i]
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            if hi == lo:
                continue
            have, start = self.rows.get(rid, 0), int(starts[i])
            if start > have and self.prefix is not None:
                have = self._fill_from_prefix(rid, have, start)
            if start != have:
                self.missing_rows.setdefault(rid, []).append((have, start))
            if missing:
                self.missing_layers.setdefault(rid, set()).update(missing)
                rows = np.zeros((hi - lo, len(self.layer_ids), self.topk), dtype=self.dtype)
            else:
                rows = ids[lo:hi]
            self.per_request.setdefault(rid, []).append(rows)
            self.rows[rid] = start + hi - lo
            if self.prefix is not None and not missing and rid not in self.missing_rows:
                self.prefix.store(rid, self.per_request[rid], self.rows[rid])

    def _fill_from_prefix(self, rid: str, have: int, start: int) -> int:
        rows = self.prefix.lookup(rid, have, start)
        if rows is not None:
            self.per_request.setdefault(rid, []).append(rows)
            self.rows[rid] = start
            return start
        return have

    def stop(self) -> None:
        for _, router in self.routers:
            router.set_capture_fn(None)
        remove_listener(self.runner, self)

    def pop(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """Routes [tokens, moe_layers, topk] per request, removed from the engine. ValueError for a request that was
        never captured or whose routes are incomplete (nothing is removed then)."""
        keys = {}
        for rid in request_ids:
            # the engine core suffixes the caller's request id ("0" -> "0-1a2b3c4d")
            match = [k for k in self.per_request if k == rid or k.startswith(f"{rid}-")]
            if len(match) != 1:
                raise ValueError(f"no unique captured routes for request {rid!r} (matches {match}; pending: "
                                 f"{sorted(self.per_request)[:5]})")
            key = keys[rid] = match[0]
            layers, gaps = self.missing_layers.get(key), self.missing_rows.get(key)
            if layers or gaps:
                raise ValueError(f"incomplete routes for request {rid!r}: "
                                 + (f"MoE layers {sorted(layers)} did not report routes; " if layers else "")
                                 + (f"token rows {', '.join(f'{a}..{b - 1}' for a, b in gaps)} were never "
                                    "captured (served from the prefix cache without stored routes?)" if gaps else ""))
        out = {}
        for rid, key in keys.items():
            out[rid] = np.concatenate(self.per_request.pop(key), axis=0)
            self.rows.pop(key, None)
            if self.prefix is not None:
                self.prefix.forget(key)
        return out

    def discard(self, request_ids: list[str]) -> int:
        """Drop whatever was captured for these requests (aborted or failed ones); unknown ids are ignored. Returns
        how many captured requests were dropped."""
        keys = [k for k in self.per_request for rid in request_ids if k == rid or k.startswith(f"{rid}-")]
        for key in set(keys):
            self.per_request.pop(key, None)
            self.rows.pop(key, None)
            self.missing_layers.pop(key, None)
            self.missing_rows.pop(key, None)
            if self.prefix is not None:
                self.prefix.forget(key)
        return len(set(keys))

    def meta(self) -> dict:
        return {"layer_ids": self.layer_ids, "num_experts": self.num_experts, "topk": self.topk,
                "pending_requests": len(self.per_request), "prefix_caching": self.prefix is not None,
                "prefix_route_hits": self.prefix.hits if self.prefix is not None else 0}

    def new_weights(self, keep_salts=frozenset()) -> None:
        """The served versions changed: stored prompt routes are stale except those of the salts still served
        (the versions still held, the base model)."""
        if self.prefix is not None:
            self.prefix.clear(keep_salts)
