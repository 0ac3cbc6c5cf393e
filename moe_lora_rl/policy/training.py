"""The training core both drivers call (the main job's Policy and verl's MoELoRAEngine): one rank's model stage with
its adapters, their AdamW, the router replayer and the adapter version.

    adapters(on/off) | run(microbatches): arm replayer -> queue routes per microbatch -> megatron's schedule ->
    check consumed -> [disagreement | recorded] -> ALWAYS replayer.clear() (mode DISABLED), errors included
    | step(max_norm): sync -> norm over unique owner shards -> clip -> AdamW, or skip on a non-finite norm
    (policy/optimizer_step.py) -> version += 1 when stepped | push(transport): the LoRA-only refit

The drivers own their batch formats and losses (the main job: PolicyBatch and verl's policy loss at the global
token count; verl: TensorDict micro-batches, its loss_function and dp_size scaling); label log-probs and SP
padding are policy/logprobs.py.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from ..lora import LoRAConfig, adapter_factors, adapters_disabled
from ..megatron.forward import run_schedule
from ..megatron.layout import Layout
from ..megatron.moe_options import transformer_overrides
from ..megatron.run_config import RunConfig
from ..router_replay.replayer import Mode, RouterReplayer
from ..router_replay.routes import RoutesBatch
from ..router_replay.staging import (check_routes, disagreement, gather_recorded, queue_routes, stage_view,
                                     token_disagreement)
from .model import build_from_hf
from .optimizer_step import StepResult, adapter_step, make_adamw

REPLAY = ("off", "record", "replay")


@dataclass
class PassResult:
    outputs: list                               # on_output's results (last pipeline stage; empty elsewhere)
    disagreement: dict[int, float] | None       # replay with measure: per global MoE layer (every rank)
    recorded: RoutesBatch | None                # record: the pass's routes in the capture format (every rank)
    token_disagreement: float | None = None     # replay with measure: routed tokens differing in >= 1 layer


class TrainingCore:
    def __init__(self, model_path, layout: Layout, rc: RunConfig, lora: LoRAConfig, *, adamw: dict | None,
                 override_transformer_config: Mapping | None = None):
        """Parallel state initialised for `layout`, host prepared. adamw: torch.optim.AdamW's keyword arguments, or
        None for a forward-only core (no optimizer). override_transformer_config: a user's megatron-core options
        (verl's key of that name), honoured or refused in one line by megatron.moe_options.transformer_overrides
        (activation recompute included: the router replays the same routes in the recompute)."""
        self.lora = lora
        kw = transformer_overrides(override_transformer_config, layout, rc)
        self.arch, self.model = build_from_hf(model_path, layout, rc, lora=lora, **kw)
        self.params = [p for _, p in adapter_factors(self.model)]
        self.optimizer = None if adamw is None else make_adamw(self.params, **adamw)
        self.replayer = RouterReplayer(self.model)
        self.view = stage_view(self.model, self.arch)
        self.version = 0
        self.last_step: StepResult | None = None
        self._stream = None                     # refit/gather.prepare's plan of this model, made at the first push

    def adapters(self, enabled: bool):
        """A scope with the adapters on (nothing changes) or off (the reference policy: exactly the base model)."""
        return contextlib.nullcontext() if enabled else adapters_disabled(self.model)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def run(self, microbatches: list[dict], *, forward_only: bool, on_output: Callable, seq_length: int,
            micro_batch_size: int, replay: str = "off", routes: RoutesBatch | None = None,
            rows: list[list[int]] | None = None, lengths: list[int] | None = None,
            measure: bool = False) -> PassResult:
        """Every microbatch through megatron's schedule (run_schedule's contract for on_output), routers armed by
        `replay`: "off" routes freely, "record" records (R2; rows/lengths say where each microbatch's rows sit in
        the batch), "replay" replays routes.samples[rows[k]] in microbatch k (lengths: tokens per sample of
        `routes`; measure: also the router disagreement). The replayer is empty and DISABLED afterwards, whatever
        happened."""
        if replay not in REPLAY:
            raise ValueError(f"replay={replay!r} is not one of {REPLAY}")
        try:
            if replay == "replay":
                check_routes(routes, lengths, self.view)
                self.replayer.set_mode(Mode.REPLAY, backward=not forward_only)
                queue_routes(self.replayer, routes, rows, lengths, seq_length, self.view, measure)
            else:
                self.replayer.set_mode(Mode.RECORD if replay == "record" else Mode.DISABLED)
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                outs = run_schedule(self.model, microbatches, forward_only=forward_only, on_output=on_output,
                                    seq_length=seq_length, micro_batch_size=micro_batch_size)
            self.replayer.check_consumed()
            measured = replay == "replay" and measure
            dis = disagreement(self.replayer, self.arch.num_layers) if measured else None
            tok = token_disagreement(self.replayer) if measured else None
            rec = gather_recorded(self.replayer, rows, lengths, seq_length, self.view) if replay == "record" else None
            return PassResult(list(outs), dis, rec, tok)
        finally:
            self.replayer.clear()

    def step(self, max_norm: float, *, grad_divisor: int = 1) -> StepResult:
        """One AdamW step of the adapters, or a skip on a non-finite norm (policy/optimizer_step.py); the version advances only
        with a step. Collective."""
        if self.optimizer is None:
            raise ValueError("this training core is forward-only (built with adamw=None): no optimizer to step")
        res = adapter_step(self.model, self.optimizer, max_norm, grad_divisor)
        if not res.skipped:
            self.version += 1
        self.last_step = res
        return res

    def push(self, transport, version: int, *, collect_to: int | None = 0, owner: str | None = None):
        """LoRA-only push of the adapters (collective: every rank calls it). collect_to=0: rank 0 holds the
        transport (the others may pass None); None: every rank holds one. Returns the PushResult on the committing
        rank, None elsewhere. owner: the policy whose version it is, when several share the engine."""
        from ..refit.gather import prepare
        from ..refit.push import push_stream
        from ..transfer.interface import BUCKET_BYTES

        if self._stream is None:                # the model keeps its adapter parameters: planned once
            self._stream = prepare(self.model, self.arch, BUCKET_BYTES)
        return push_stream(self.model, self.arch, transport, version, self.lora.rank, self.lora.alpha,
                           collect_to=collect_to, owner=owner, prepared=self._stream)
