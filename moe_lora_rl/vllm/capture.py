"""Routing capture in vLLM for router replay (R3): per request, the top-k logical expert ids of every token the
engine forwards (prompt and generated; the last sampled token is never forwarded) for every MoE layer.

vLLM's own routed-experts output needs Model Runner V2 (Triton), so on CPU we bind BaseRouter.set_capture_fn
(ids are logical: captured before the EPLB mapping) and wrap the runner's _model_forward (instance attribute) to
split each step's ids by request (query_start_loc). Stored compactly (uint8 for <= 256 experts, else uint16) and
freed when popped. Needs eager mode (a compiled graph would have traced the capture branch away) and no prefix
caching (cached prompt tokens are not forwarded, so their routes would be missing).
"""
from __future__ import annotations


import numpy as np
import torch

from ..models.naming import layer_of
from ..router_replay.routes import compact_dtype


class RouteCapture:
    def __init__(self, runner):
        cfg = runner.vllm_config
        if cfg.cache_config.enable_prefix_caching:
            raise ValueError("routing capture needs enable_prefix_caching=False: cached prompt tokens are not "
                             "forwarded, so their routes would be missing")
        if cfg.compilation_config.mode not in (0, None) and not cfg.model_config.enforce_eager:
            raise ValueError("routing capture needs enforce_eager=True (compiled graphs drop the capture hook)")
        self.runner = runner
        self.routers: list[tuple[int, object]] = []
        for name, mod in runner.model.named_modules():
            router = getattr(mod, "router", None)
            layer = layer_of(name)
            if router is not None and hasattr(router, "set_capture_fn") and layer is not None:
                self.routers.append((layer, router))
        self.routers.sort(key=lambda x: x[0])
        if not self.routers:
            raise ValueError("no MoE router with a capture hook found in the served model")
        self.layer_ids = [l for l, _ in self.routers]
        r0 = self.routers[0][1]
        self.num_experts, self.topk = int(r0.global_num_experts), int(r0.top_k)
        self.dtype = compact_dtype(self.num_experts)
        self.step: dict[int, torch.Tensor] = {}
        self.per_request: dict[str, list[np.ndarray]] = {}
        self._orig_forward = None

    def start(self) -> None:
        for layer, router in self.routers:
            router.set_capture_fn(lambda ids, layer=layer: self.step.__setitem__(layer, ids.detach().to("cpu")))
        runner, orig = self.runner, self.runner._model_forward
        self._orig_forward = orig

        def forward(*args, **kwargs):
            num = runner.input_batch.num_reqs
            req_ids = list(runner.input_batch.req_ids[:num])
            qsl = runner.query_start_loc.np[: num + 1].copy()
            self.step.clear()
            out = orig(*args, **kwargs)
            if len(self.step) == len(self.routers):
                ids = np.stack([self.step[l].numpy() for l in self.layer_ids], axis=1).astype(self.dtype)
                for i, rid in enumerate(req_ids):
                    self.per_request.setdefault(rid, []).append(ids[qsl[i]:qsl[i + 1]])
            self.step.clear()
            return out
        runner._model_forward = forward

    def stop(self) -> None:
        for _, router in self.routers:
            router.set_capture_fn(None)
        if self._orig_forward is not None:
            del self.runner._model_forward          # back to the class method
            self._orig_forward = None

    def pop(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """Routes [tokens, moe_layers, topk] per request, removed from the engine."""
        out = {}
        for rid in request_ids:
            # the engine core suffixes the caller's request id ("0" -> "0-1a2b3c4d")
            keys = [k for k in self.per_request if k == rid or k.startswith(f"{rid}-")]
            if len(keys) != 1:
                raise ValueError(f"no unique captured routes for request {rid!r} (matches {keys}; pending: "
                                 f"{sorted(self.per_request)[:5]})")
            out[rid] = np.concatenate(self.per_request.pop(keys[0]), axis=0)
        return out

    def meta(self) -> dict:
        return {"layer_ids": self.layer_ids, "num_experts": self.num_experts, "topk": self.topk,
                "pending_requests": len(self.per_request)}
