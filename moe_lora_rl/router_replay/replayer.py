"""Replay recorded routes in megatron-core's routers (training side).

megatron-core's TopKRouter already passes `self.router_replay` into its top-k (moe_utils.topk_routing_with_score
_function -> router_replay.get_replay_topk). We use that hook point but not its RouterReplay class, which (1) keeps
a process-global registry in construction order, so two models in one process or PP stages mix up layers, (2)
reuses one target for every microbatch, (3) checks neither the token count nor the expert ids, and (4) cannot tell
whether every route was used. Here every router gets a RouteReplay that knows its global layer number and holds a
queue with one entry per microbatch, consumed exactly once per forward (and once more by activation recompute, when
the forward ran inside megatron-core's checkpoint: the recompute re-runs the router in backward and must get the same
routes).

A queued microbatch may carry a mask of its real (routed) tokens: the replay then also computes the router's own
top-k for those tokens and counts the decisions (token x top-k slot) whose replayed expert the router would not
have chosen -- the router disagreement of R3, per global layer.

The gating weights still come from the training router's scores at the replayed experts (scores.gather), so the
router keeps its gradient.
"""
from __future__ import annotations

from collections import deque
from enum import Enum

import torch


class Mode(str, Enum):
    DISABLED = "disabled"
    RECORD = "record"      # compute routes and keep them (R2: the old policy's pass)
    REPLAY = "replay"      # use queued routes (R2 later mini-batches, R3 rollout routes)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _in_checkpointed_forward() -> bool:
    """In a pass that a backward follows (RouteReplay.backward), the router runs with grad disabled only inside
    megatron-core's tensor_parallel.checkpoint (full recompute, selective 'moe'), whose forward is no_grad: those
    routes are asked for again when backward recomputes the chunk. Layers outside a checkpoint (recompute_method
    block past recompute_num_layers) run with grad enabled and are never recomputed. (megatron-core's own
    is_checkpointing() flag is not nest-safe: the shared-expert checkpoint inside the MoE checkpoint clears it.)"""
    return not torch.is_grad_enabled()


class RouteReplay:
    def __init__(self, layer: int, num_experts: int, topk: int, recompute: bool):
        self.layer, self.num_experts, self.topk, self.recompute = layer, num_experts, topk, recompute
        self.mode = Mode.DISABLED
        self.backward = False              # a backward follows this pass (set_mode): checkpointed forwards keep a copy
        self.keep_replayed = False         # REPLAY mode keeps nothing unless asked: a long run must not hold every route
        self.queue: deque[torch.Tensor] = deque()
        self.recompute_queue: deque[torch.Tensor] = deque()
        self.recorded: list[torch.Tensor] = []
        self.measure_queue: deque[torch.Tensor | None] = deque()   # per queued microbatch: real-token mask or None
        self.disagree = [0, 0]             # [decisions the router would have made differently, decisions measured]
        self.token_flags: list[torch.Tensor] = []   # per measured microbatch: real token differs in >= 1 decision
        self.consumed = [0, 0]             # replayed routes used since the last set_mode: [forward, recompute]

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.mode is Mode.DISABLED:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode is Mode.RECORD:
            probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if not in_backward():
                self.recorded.append(idx.detach().clone())
            return probs, idx
        if self.recompute and in_backward():
            if not self.recompute_queue:
                raise ValueError(f"layer {self.layer}: activation recompute found no replayed route to reuse")
            idx = self.recompute_queue.popleft()
            self.consumed[1] += 1
        else:
            if not self.queue:
                raise ValueError(f"layer {self.layer}: no recorded route left for a forward of {scores.shape[0]} "
                                 "tokens (more microbatches than routes were queued)")
            idx = self.queue.popleft()
            real = self.measure_queue.popleft() if self.measure_queue else None
            if tuple(idx.shape) != (scores.shape[0], topk):
                raise ValueError(f"layer {self.layer}: routes of shape {tuple(idx.shape)} for a router input of "
                                 f"{scores.shape[0]} tokens with top-k {topk}")
            if real is not None:
                self._measure(scores, topk, idx, real, num_groups, group_topk, default_compute_topk)
            self.consumed[0] += 1
            if self.recompute and self.backward and _in_checkpointed_forward():
                self.recompute_queue.append(idx)
        idx = idx.to(scores.device)
        if self.keep_replayed and not in_backward():
            self.recorded.append(idx)
        return scores.gather(1, idx), idx

    @torch.no_grad()
    def _measure(self, scores, topk, idx, real, num_groups, group_topk, default_compute_topk) -> None:
        if real.shape != (scores.shape[0],):
            raise ValueError(f"layer {self.layer}: real-token mask of shape {tuple(real.shape)} for a router input "
                             f"of {scores.shape[0]} tokens")
        _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
        real = real.to(scores.device)
        got, want = idx.to(scores.device)[real], own[real]
        chosen = (got.unsqueeze(-1) == want.unsqueeze(-2)).any(-1)
        self.disagree[0] += int((~chosen).sum())
        self.disagree[1] += chosen.numel()
        self.token_flags.append((~chosen).any(-1).cpu())


class RouterReplayer:
    """Attach RouteReplay objects to every TopKRouter of a model stage; queue, replay, record, check."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        cfg = model.config
        recompute = cfg.recompute_granularity is not None
        self.replays: list[RouteReplay] = []
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if isinstance(router, TopKRouter):
                rp = RouteReplay(layer.layer_number - 1, cfg.num_moe_experts, cfg.moe_router_topk, recompute)
                router.router_replay = rp
                self.replays.append(rp)
        self.routers = [layer.mlp.router for layer in model.decoder.layers
                        if isinstance(getattr(getattr(layer, "mlp", None), "router", None), TopKRouter)]

    @property
    def layer_ids(self) -> list[int]:
        return [r.layer for r in self.replays]

    def set_mode(self, mode: Mode | str, keep_replayed: bool = False, *, backward: bool = False) -> None:
        """keep_replayed: in REPLAY mode also keep the replayed routes for pop_recorded (off by default). backward:
        a backward follows the pass, so with activation recompute each route replayed inside a checkpointed forward
        is kept for the recompute (a forward-only pass may still run megatron-core's checkpoint: no copy then)."""
        mode = Mode(mode)
        for r in self.replays:
            r.mode, r.keep_replayed, r.backward = mode, bool(keep_replayed), bool(backward)
            r.consumed = [0, 0]

    def queue_microbatch(self, per_layer: list[torch.Tensor], real: torch.Tensor | None = None) -> None:
        """One microbatch's routes, one [tokens, topk] tensor per MoE layer of this stage. real: optional bool
        [tokens] mask of the tokens whose routes are real (not padding); given, the replay measures router
        disagreement on them (pop_disagreement)."""
        if len(per_layer) != len(self.replays):
            raise ValueError(f"routes for {len(per_layer)} MoE layers, this stage has {len(self.replays)} "
                             f"(global layers {self.layer_ids})")
        for r, idx in zip(self.replays, per_layer):
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= r.num_experts):
                raise ValueError(f"layer {r.layer}: expert id out of range 0..{r.num_experts - 1} "
                                 f"(min {int(idx.min())}, max {int(idx.max())})")
            if real is not None and tuple(real.shape) != (idx.shape[0],):
                raise ValueError(f"layer {r.layer}: real-token mask of shape {tuple(real.shape)} for routes of "
                                 f"{idx.shape[0]} tokens")
        for r, idx in zip(self.replays, per_layer):
            r.queue.append(idx.long())
            r.measure_queue.append(None if real is None else real.bool())     # in step with the queue

    def pop_disagreement(self) -> dict[int, tuple[int, int]]:
        """{global layer: (decisions the router would have made differently, decisions measured)} since the last
        pop, for this stage's layers (this rank's tokens only)."""
        out = {r.layer: tuple(r.disagree) for r in self.replays}
        for r in self.replays:
            r.disagree = [0, 0]
        return out

    def pop_token_flags(self) -> torch.Tensor | None:
        """Per measured real token of this stage (microbatches in schedule order), whether the router of any of
        this stage's layers would have chosen differently; None on a stage without MoE layers."""
        if not self.replays:
            return None
        per_layer = [torch.cat(r.token_flags) if r.token_flags else torch.zeros(0, dtype=torch.bool)
                     for r in self.replays]
        for r in self.replays:
            r.token_flags = []
        if len({t.numel() for t in per_layer}) != 1:
            raise AssertionError(f"layers measured different token counts: {[t.numel() for t in per_layer]}")
        return torch.stack(per_layer).any(0)

    def consumed(self) -> dict[int, tuple[int, int]]:
        """{global layer: (routes replayed in forwards, routes replayed again by activation recompute)} since the
        last set_mode (kept by clear: the counts of the pass that just ended)."""
        return {r.layer: tuple(r.consumed) for r in self.replays}

    def check_consumed(self) -> None:
        """Every queued route used exactly once (and every recompute copy too)."""
        left = {r.layer: (len(r.queue), len(r.recompute_queue)) for r in self.replays
                if r.queue or r.recompute_queue}
        if left:
            raise ValueError(f"routes left unconsumed per layer (forward, recompute): {left}")

    def pop_recorded(self) -> list[list[torch.Tensor]]:
        out = [r.recorded for r in self.replays]
        for r in self.replays:
            r.recorded = []
        return out

    def clear(self) -> None:
        """Drop every queued, recorded and measured route (after a failed pass), back to DISABLED."""
        for r in self.replays:
            r.queue.clear(), r.recompute_queue.clear(), r.measure_queue.clear()
            r.recorded, r.disagree, r.mode, r.keep_replayed, r.backward = [], [0, 0], Mode.DISABLED, False, False
            r.token_flags = []

    def detach(self) -> None:
        for router in self.routers:
            router.router_replay = None
        self.replays, self.routers = [], []
