"""The Megatron policy of the RL run: logprobs of a global batch (with or without router replay, with or without the
adapters) and one optimizer step of the adapters on verl's policy loss.

    batch (identical on every rank) -> DP share -> microbatches -> megatron schedule (PP hand-offs) -> last stage:
    label logprobs at temperature -> [logprobs: broadcast to every rank] | [update: verl policy loss normalised by
    the global batch -> backward -> sync_adapter_grads -> global norm over unique adapter shards -> clip -> AdamW]

Gradients of replicated adapter factors are summed over their data-parallel replicas (lora.grad_sync), so each
microbatch's loss is its share of the GLOBAL loss: verl's agg_loss with the global token / sequence counts and
dp_size=1 (verl's dp_size factor undoes DDP's averaging, which is not used here). The result is the same at every
layout and microbatch split, up to fp32 reduction order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..algos import (GlobalBatch, PolicyLossSettings, aggregate, kl_penalty, policy_loss,
                                      rollout_correction)
from ..lora import LoRAConfig, adapter_factors, adapters_disabled, sync_adapter_grads
from ..lora.grad_norm import clip_adapter_grads
from ..megatron.forward import run_schedule
from .model import build_from_hf
from ..megatron.layout import Layout
from ..megatron.run_config import RunConfig
from ..megatron.train_step import token_log_probs
from ..router_replay.replay import Mode, RouterReplayer
from ..router_replay.routes import RoutesBatch
from ..router_replay.staging import check_routes, disagreement, gather_recorded, queue_routes, stage_view

LOGPROB_REPLAY = ("r3", "record", "off")
UPDATE_REPLAY = ("r3", "r2", "off")      # r3: `routes` if given, else batch.routes; r2: `routes` (recorded) required
ROLLOUT_IS = ("token", "sequence", None)
_ADAPTER_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass
class PolicyBatch:
    """The step's global batch, identical on every rank."""
    tokens: torch.Tensor                      # [N, S] int64, prompt + response, right-padded
    lengths: list[int]                        # real tokens per row (prompt + response)
    loss_mask: torch.Tensor                   # [N, S-1] bool: True where label tokens[:, 1:] is a response token
    advantages: torch.Tensor                  # [N, S-1] float32 token-level (0 outside loss_mask)
    rollout_logprobs: torch.Tensor | None     # [N, S-1] float32 rollout logprobs of the labels (0 outside loss_mask)
    routes: RoutesBatch | None                # samples[i]: [lengths[i]-1, n_moe_layers, topk]
    group_ids: list[int]                      # prompt id per row (GRPO groups)

    def __post_init__(self):
        t = self.tokens
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.int64:
            raise ValueError(f"tokens must be an int64 [N, S] tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        n, s = t.shape
        if n == 0 or s < 2:
            raise ValueError(f"tokens of shape {(n, s)}: need at least one row of at least 2 tokens")
        self.lengths = [int(x) for x in self.lengths]
        if len(self.lengths) != n or any(not 2 <= x <= s for x in self.lengths):
            raise ValueError(f"lengths {self.lengths} must be {n} values in 2..{s}")
        if len(self.group_ids) != n:
            raise ValueError(f"{len(self.group_ids)} group ids for {n} rows")
        for name in ("loss_mask", "advantages", "rollout_logprobs"):
            v = getattr(self, name)
            if v is None and name == "rollout_logprobs":
                continue
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (n, s - 1):
                raise ValueError(f"{name} has shape {tuple(getattr(v, 'shape', ()))}, expected {(n, s - 1)}")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"loss_mask must be bool, got {self.loss_mask.dtype}")
        outside = self.loss_mask & ~self.label_mask()
        if outside.any():
            row, col = (int(x) for x in outside.nonzero()[0])
            raise ValueError(f"loss_mask is True at row {row}, position {col}: beyond the row's last label "
                             f"(length {self.lengths[row]})")

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def label_mask(self) -> torch.Tensor:
        """[N, S-1] bool: position t has a real label (t < lengths[i] - 1)."""
        return torch.arange(self.seq_len - 1)[None, :] < (torch.tensor(self.lengths)[:, None] - 1)


@dataclass
class LogprobResult:
    logprobs: torch.Tensor                      # [N, S-1] fp32 on every rank (0 where the label is padding)
    disagreement: dict[int, float] | None       # r3: per global MoE layer, fraction of routed-token decisions
    recorded: RoutesBatch | None                # record: this pass's routes in the capture format


@dataclass(frozen=True)
class _Plan:
    microbatches: list[list[int]]               # this rank's rows, per microbatch, in schedule order
    padded_len: int                             # S rounded up to split over sequence-parallel ranks


class Policy:
    def __init__(self, model_path, layout: Layout, rc: RunConfig, lora: LoRAConfig, *, lr: float,
                 weight_decay: float, grad_clip: float, loss: PolicyLossSettings, micro_batch_size: int,
                 temperature: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999)):
        """Parallel state must be initialised for `layout` (megatron.parallel.init_distributed) and the host
        prepared (run_config.prepare_host). The adapters take rc.adapter_dtype."""
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size!r} must be a positive integer")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0")
        if not lr >= 0 or weight_decay < 0:           # lr=0: the control run (everything but the step)
            raise ValueError(f"lr={lr!r} and weight_decay={weight_decay!r} must be >= 0")
        if not isinstance(loss, PolicyLossSettings):
            raise ValueError(f"loss must be a PolicyLossSettings, got {type(loss).__name__}")
        self.lora = dataclasses.replace(lora, dtype=_ADAPTER_DTYPE[rc.adapter_dtype])
        self.rc, self.layout = rc, layout
        self.loss, self.grad_clip = loss, float(grad_clip)
        self.micro_batch_size, self.temperature = micro_batch_size, float(temperature)
        self.arch, self.model = build_from_hf(model_path, layout, rc, lora=self.lora)
        self.params = [p for _, p in adapter_factors(self.model)]
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas={tuple(betas)!r}: need two values in [0, 1)")
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=tuple(betas))
        self.replayer = RouterReplayer(self.model)
        self.view = stage_view(self.model, self.arch)
        self.version = 0

    # -- the batch on this rank ------------------------------------------------------------------------------------
    def _plan(self, batch: PolicyBatch) -> _Plan:
        from megatron.core import parallel_state as ps

        if not isinstance(batch, PolicyBatch):
            raise ValueError(f"batch must be a PolicyBatch, got {type(batch).__name__}")
        dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        n, mbs = batch.num_rows, self.micro_batch_size
        if n % dp:
            raise ValueError(f"global batch of {n} rows does not split over data parallel size {dp}")
        local = n // dp
        if local % mbs:
            raise ValueError(f"{local} rows per data-parallel rank (batch {n} / dp {dp}) do not split into "
                             f"microbatches of micro_batch_size={mbs}")
        rows = list(range(r * local, (r + 1) * local))
        split = self.view.tp_size if self.view.sequence_parallel else 1
        return _Plan([rows[i:i + mbs] for i in range(0, local, mbs)], math.ceil(batch.seq_len / split) * split)

    def _microbatches(self, batch: PolicyBatch, plan: _Plan) -> list[dict]:
        s = batch.seq_len
        out = []
        for ids in plan.microbatches:
            tok = batch.tokens[ids]
            if plan.padded_len > s:                 # extra right padding so the sequence splits over SP ranks
                tok = torch.cat([tok, tok.new_zeros(len(ids), plan.padded_len - s)], dim=1)
            out.append({"tokens": tok, "ids": ids})
        return out

    def _label_logprobs(self, logits_local: torch.Tensor, tokens: torch.Tensor, s: int) -> torch.Tensor:
        """[b, S-1] fp32 log p(tokens[:, t+1]) at the policy's temperature (autograd-aware, TP-reduced)."""
        labels = torch.roll(tokens, -1, dims=1).to(logits_local.device)
        return token_log_probs(logits_local.float() / self.temperature, labels, self.arch.vocab_size)[:, :s - 1]

    def _arm(self, replay: str, routes: RoutesBatch | None, batch: PolicyBatch, plan: _Plan, measure: bool) -> None:
        if replay in ("r3", "r2"):
            self.replayer.set_mode(Mode.REPLAY)
            queue_routes(self.replayer, routes, plan.microbatches, batch.lengths, plan.padded_len, self.view, measure)
        else:
            self.replayer.set_mode(Mode.RECORD if replay == "record" else Mode.DISABLED)

    # -- forward only ----------------------------------------------------------------------------------------------
    def logprobs(self, batch: PolicyBatch, *, replay: str = "r3", adapter: bool = True) -> LogprobResult:
        """Label logprobs [N, S-1] (fp32, every rank; 0 where the label is padding). replay: "r3" replays
        batch.routes and measures router disagreement, "record" records this pass's routes (R2), "off" routes
        freely. adapter=False: the reference policy (adapters switched off)."""
        from megatron.core import parallel_state as ps

        if replay not in LOGPROB_REPLAY:
            raise ValueError(f"replay={replay!r} is not one of {LOGPROB_REPLAY}")
        plan = self._plan(batch)
        routes = check_routes(batch.routes, batch.lengths, self.view) if replay == "r3" else None
        s = batch.seq_len
        self.model.eval()
        try:
            self._arm(replay, routes, batch, plan, measure=True)
            with torch.no_grad(), (contextlib.nullcontext() if adapter else adapters_disabled(self.model)):
                outs = run_schedule(self.model, self._microbatches(batch, plan), forward_only=True,
                                    on_output=lambda t, mb: self._label_logprobs(t, mb["tokens"], s).cpu(),
                                    seq_length=plan.padded_len, micro_batch_size=self.micro_batch_size)
            self.replayer.check_consumed()
        except BaseException:
            self.replayer.clear()
            raise
        full = torch.zeros(batch.num_rows, s - 1, dtype=torch.float32)
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            for ids, lp in zip(plan.microbatches, outs):
                full[ids] = lp.float()
        dist.all_reduce(full)                   # one contributor per row: the last stage's TP rank 0 of its DP rank
        full = torch.where(batch.label_mask(), full, torch.zeros(()))
        dis = disagreement(self.replayer, self.arch.num_layers) if replay == "r3" else None
        rec = gather_recorded(self.replayer, plan.microbatches, batch.lengths, plan.padded_len, self.view) \
            if replay == "record" else None
        self.replayer.set_mode(Mode.DISABLED)
        return LogprobResult(full, dis, rec)

    # -- one optimizer step ----------------------------------------------------------------------------------------
    def update(self, batch: PolicyBatch, old_logprobs: torch.Tensor, *, replay: str = "r3",
               routes: RoutesBatch | None = None, ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
               rollout_is: str | None = "token", rollout_is_threshold: float = 2.0) -> dict:
        """One AdamW step of the adapters over the global batch. replay: "r3" replays `routes` if given, else
        batch.routes; "r2" replays `routes` (recorded by logprobs(replay="record")); "off" routes freely.
        Returns {"loss", "grad_norm" (before clipping), "clipped", "pg_clipfrac", "kl" (verl's low-variance KL to
        ref_logprobs aggregated like the loss; 0 without them), "lr"}, the same on every rank. rollout_is None: no
        rollout correction (also when batch.rollout_logprobs is None)."""
        from megatron.core import parallel_state as ps

        if replay not in UPDATE_REPLAY:
            raise ValueError(f"replay={replay!r} is not one of {UPDATE_REPLAY} for update")
        if rollout_is not in ROLLOUT_IS:
            raise ValueError(f"rollout_is={rollout_is!r} is not one of {ROLLOUT_IS}")
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef={kl_coef!r} must be >= 0")
        plan = self._plan(batch)
        shape = (batch.num_rows, batch.seq_len - 1)
        for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
            if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape):
                raise ValueError(f"{name} has shape {tuple(getattr(t, 'shape', ()))}, expected {shape}")
        if old_logprobs is None:
            raise ValueError("old_logprobs is None")
        if kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
        if replay == "r2" and routes is None:
            raise ValueError("replay='r2' needs routes= (the RoutesBatch recorded by logprobs(replay='record'))")
        routes = check_routes(routes if routes is not None else batch.routes, batch.lengths, self.view) \
            if replay != "off" else None
        mask = batch.loss_mask
        n_tokens = int(mask.sum())
        if n_tokens == 0:
            raise ValueError("loss_mask selects no token: nothing to train on")
        gb = GlobalBatch(dp_size=1, batch_num_tokens=n_tokens, global_batch_size=int((mask.sum(-1) > 0).sum()))
        old = old_logprobs.float()
        weights = None
        if rollout_is is not None and batch.rollout_logprobs is not None:
            weights, _ = rollout_correction(old, batch.rollout_logprobs.float(), mask, level=rollout_is,
                                            threshold=rollout_is_threshold)
        s = batch.seq_len

        advantages = batch.advantages.float()

        def loss_fn(logits_local, batch):          # batch: one microbatch dict (run_schedule's keyword)
            mb = batch
            ids = mb["ids"]
            dev = logits_local.device
            lp = self._label_logprobs(logits_local, mb["tokens"], s)
            m = mask[ids].to(dev)
            pg, metrics = policy_loss(old[ids].to(dev), lp, advantages[ids].to(dev), m, self.loss, gb,
                                      rollout_is_weights=None if weights is None else weights[ids].to(dev))
            total, kl_loss = pg, torch.zeros((), device=dev)
            if ref_logprobs is not None:            # reported whenever given; in the loss when kl_coef > 0
                kl_loss = aggregate(kl_penalty(lp, ref_logprobs[ids].float().to(dev)), m, self.loss.loss_agg_mode, gb)
                if kl_coef > 0:
                    total = pg + kl_coef * kl_loss
            logged = torch.tensor([float(total), float(kl_loss), metrics["actor/pg_clipfrac"] * float(m.sum())],
                                  dtype=torch.float64)
            return total, torch.tensor(1, dtype=torch.int, device=dev), {"stats": logged}

        for p in self.params:
            p.grad = None
        self.model.train()
        try:
            self._arm(replay, routes, batch, plan, measure=False)
            outs = run_schedule(self.model, self._microbatches(batch, plan), forward_only=False, on_output=loss_fn,
                                seq_length=plan.padded_len, micro_batch_size=self.micro_batch_size)
            self.replayer.check_consumed()
        except BaseException:
            self.replayer.clear()
            raise
        self.replayer.set_mode(Mode.DISABLED)
        stats = torch.zeros(3, dtype=torch.float64)
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            stats = sum((o["stats"] for o in outs), stats)
        dist.all_reduce(stats)
        sync_adapter_grads(self.model)
        norm, clipped = clip_adapter_grads(self.model, self.grad_clip)
        self.optimizer.step()
        self.version += 1
        return {"loss": float(stats[0]), "grad_norm": norm, "clipped": bool(clipped),
                "pg_clipfrac": float(stats[2]) / n_tokens, "kl": float(stats[1]),
                "lr": float(self.optimizer.param_groups[0]["lr"])}

    # -- refit -----------------------------------------------------------------------------------------------------
    def push(self, transport, version: int, *, collect_to: int | None = 0):
        """LoRA-only push of the adapters (collective: every rank calls it). collect_to=0: rank 0 holds the
        transport (the others may pass None); None: every rank holds one. Returns the PushResult on the committing
        rank, None elsewhere."""
        from ..refit.transports import push_stream

        return push_stream(self.model, self.arch, transport, version, self.lora.rank, self.lora.alpha,
                           collect_to=collect_to)
