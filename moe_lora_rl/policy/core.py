"""The Megatron policy of the RL run (the main job's face of policy/training.py's TrainingCore, which verl's engine
calls too): logprobs of a global batch (with or without router replay, with or without the adapters) and one
optimizer step of the adapters on verl's policy loss.

    batch (identical on every rank) -> DP share -> microbatches -> megatron schedule (PP hand-offs) -> last stage:
    label logprobs at temperature -> [logprobs: broadcast to every rank] | [update: verl policy loss normalised by
    the global batch -> backward -> sync_adapter_grads -> global norm over unique adapter shards -> clip -> AdamW,
    or a skip on a non-finite norm (policy/optimizer_step.py)]

Gradients of replicated adapter factors are summed over their data-parallel replicas (lora.grad_sync), so each
microbatch's loss is its share of the GLOBAL loss: verl's agg_loss with the global token / sequence counts, the
run's loss_scale_factor (seq-mean-token-sum-norm: never the padded width) and dp_size=1 (verl's dp_size factor undoes DDP's averaging, which is not used here). The result is the same at every
layout and microbatch split, up to fp32 reduction order.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..algos import (GlobalBatch, PolicyLossSettings, SparseCorrection, aggregate, kl_penalty, policy_loss,
                     rollout_correction, rollout_rejection, sparse_correction)
from ..lora import LoRAConfig
from ..megatron.layout import Layout
from ..megatron.run_config import RunConfig
from ..router_replay.routes import RoutesBatch
from .batch import LogprobResult, PolicyBatch
from .kv_masks import batch_masks, check_record
from .logprobs import label_logprobs, padded_len
from .training import TrainingCore

__all__ = ["Policy", "PolicyBatch", "LogprobResult"]

LOGPROB_REPLAY = ("r3", "record", "off")
UPDATE_REPLAY = ("r3", "r2", "off")      # r3: `routes` if given, else batch.routes; r2: `routes` (recorded) required
ROLLOUT_IS = ("token", "sequence", "mis", "sparse", None)   # TIS per token / sequence, MIS, Sparse-RL, none
_ADAPTER_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class _Plan:
    microbatches: list[list[int]]               # this rank's rows, per microbatch, in schedule order
    padded_len: int                             # S rounded up to split over sequence-parallel ranks


class Policy:
    """The main job's face of the training core (policy/training.py): PolicyBatch in, logprobs and update stats
    out."""

    def __init__(self, model_path, layout: Layout, rc: RunConfig, lora: LoRAConfig, *, lr: float,
                 weight_decay: float, grad_clip: float, loss: PolicyLossSettings, micro_batch_size: int,
                 temperature: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999), override_transformer_config: dict | None = None):
        """Parallel state must be initialised for `layout` (megatron.parallel.init_distributed) and the host
        prepared (run_config.prepare_host). The adapters take rc.adapter_dtype. override_transformer_config: a user's
        megatron-core options (activation recompute, MoE options), as TrainingCore takes them."""
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size!r} must be a positive integer")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0")
        if not lr >= 0 or weight_decay < 0:           # lr=0: the control run (everything but the step)
            raise ValueError(f"lr={lr!r} and weight_decay={weight_decay!r} must be >= 0")
        if not isinstance(loss, PolicyLossSettings):
            raise ValueError(f"loss must be a PolicyLossSettings, got {type(loss).__name__}")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas={tuple(betas)!r}: need two values in [0, 1)")
        self.rc, self.layout = rc, layout
        self.loss, self.grad_clip = loss, float(grad_clip)
        self.micro_batch_size, self.temperature = micro_batch_size, float(temperature)
        lora = dataclasses.replace(lora, dtype=_ADAPTER_DTYPE[rc.adapter_dtype])
        self.core = TrainingCore(model_path, layout, rc, lora,
                                 adamw=dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas)),
                                 override_transformer_config=override_transformer_config)

    # the core's state, under the names the main job and its checks use
    lora = property(lambda self: self.core.lora)
    arch = property(lambda self: self.core.arch)
    model = property(lambda self: self.core.model)
    params = property(lambda self: self.core.params)
    optimizer = property(lambda self: self.core.optimizer)
    replayer = property(lambda self: self.core.replayer)
    view = property(lambda self: self.core.view)

    @property
    def version(self) -> int:
        return self.core.version

    @version.setter
    def version(self, v: int) -> None:
        self.core.version = int(v)

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
        return _Plan([rows[i:i + mbs] for i in range(0, local, mbs)], padded_len(batch.seq_len, self.view))

    def _microbatches(self, batch: PolicyBatch, plan: _Plan) -> list[dict]:
        s = batch.seq_len
        out = []
        for ids in plan.microbatches:
            tok = batch.tokens[ids]
            if plan.padded_len > s:                 # extra right padding so the sequence splits over SP ranks
                tok = torch.cat([tok, tok.new_zeros(len(ids), plan.padded_len - s)], dim=1)
            mb = {"tokens": tok, "ids": ids}
            if batch.kv_kept is not None:
                mb["layer_masks"] = self._kv_masks(batch, ids, tok.shape[1])
            out.append(mb)
        return out

    def _kv_masks(self, batch: PolicyBatch, ids: list[int], width: int) -> dict:
        """KV replay: per layer, each row's queries see the tokens its sampler held (policy/kv_masks.py)."""
        from megatron.core import parallel_state as ps

        a = self.arch
        for i in ids:
            check_record(batch.kv_kept[i], batch.lengths[i], a.num_layers, a.num_kv_heads, row=i)
        return batch_masks([batch.kv_kept[i] for i in ids], width, a.num_layers, a.num_heads, a.num_kv_heads,
                           ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())

    def _label_logprobs(self, logits_local: torch.Tensor, tokens: torch.Tensor, s: int) -> torch.Tensor:
        """[b, S-1] fp32 log p(tokens[:, t+1]) at the policy's temperature (autograd-aware, TP-reduced)."""
        return label_logprobs(logits_local, tokens, self.arch.vocab_size, self.temperature)[:, :s - 1]

    def _run(self, batch: PolicyBatch, plan: _Plan, replay: str, routes: RoutesBatch | None, **kw):
        mode = {"r3": "replay", "r2": "replay", "record": "record", "off": "off"}[replay]
        return self.core.run(self._microbatches(batch, plan), seq_length=plan.padded_len,
                             micro_batch_size=self.micro_batch_size, replay=mode, routes=routes,
                             rows=plan.microbatches, lengths=batch.lengths, **kw)

    # -- forward only ----------------------------------------------------------------------------------------------
    def logprobs(self, batch: PolicyBatch, *, replay: str = "r3", adapter: bool = True) -> LogprobResult:
        """Label logprobs [N, S-1] (fp32, every rank; 0 where the label is padding). replay: "r3" replays
        batch.routes and measures router disagreement, "record" records this pass's routes (R2), "off" routes
        freely. adapter=False: the reference policy (adapters switched off)."""
        from megatron.core import parallel_state as ps

        if replay not in LOGPROB_REPLAY:
            raise ValueError(f"replay={replay!r} is not one of {LOGPROB_REPLAY}")
        plan = self._plan(batch)
        routes = batch.routes if replay == "r3" else None           # checked by TrainingCore.run
        s = batch.seq_len
        self.model.eval()
        with self.core.adapters(adapter):
            res = self._run(batch, plan, replay, routes, forward_only=True, measure=True,
                            on_output=lambda t, mb: self._label_logprobs(t, mb["tokens"], s).cpu())
        return LogprobResult(self._gather_rows(batch, zip(plan.microbatches, res.outputs)), res.disagreement,
                             res.recorded, res.token_disagreement)

    def _gather_rows(self, batch: PolicyBatch, parts) -> torch.Tensor:
        """[N, S-1] fp32 on every rank from (rows, logprobs) pieces held by the last stage (0 on padding labels)."""
        from megatron.core import parallel_state as ps

        full = torch.zeros(batch.num_rows, batch.seq_len - 1, dtype=torch.float32)
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            for ids, lp in parts:
                full[ids] = lp.float()
        dist.all_reduce(full)                   # one contributor per row: the last stage's TP rank 0 of its DP rank
        return torch.where(batch.label_mask(), full, torch.zeros(()))

    # -- one optimizer step ----------------------------------------------------------------------------------------
    def update(self, batch: PolicyBatch, old_logprobs: torch.Tensor, *, replay: str = "r3",
               routes: RoutesBatch | None = None, ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
               rollout_is: str | None = "token", rollout_is_threshold: float = 2.0,
               sparse: SparseCorrection = SparseCorrection(), proximal_out: list | None = None) -> dict:
        """One AdamW step of the adapters over the global batch. replay: "r3" replays `routes` if given, else
        batch.routes; "r2" replays `routes` (recorded by logprobs(replay="record")); "off" routes freely.
        Returns {"loss", "grad_norm" (before clipping), "clipped", "skipped" (no step, the version unchanged: a
        non-finite grad norm, policy/optimizer_step.py, or every token rejected by "mis"), "pg_clipfrac", "kl" (verl's
        low-variance KL to ref_logprobs aggregated like the loss; 0 without them), "lr", "rollout_rejected_frac",
        and with batch.rollout_logprobs "update_rollout_kl": the k3 (mismatch.k3_kl) between this
        forward's logprobs and the rollout's over the loss_mask tokens, before any rejection (the engine-vs-trainer
        check of the update pass itself)}, the same on every rank.

        Rollout correction, from the proximal policy (old_logprobs) to the behaviour policy (batch.rollout_logprobs),
        ratio = exp(old - rollout) per token: "token" / "sequence" weight the loss by the truncated ratio
        min(ratio, rollout_is_threshold) (TIS); "mis" (masked IS, verl's token_k1 rejection) drops every token with
        ratio outside [1/threshold, threshold] from the loss and keeps the rest at weight 1. As in verl, the rejected
        tokens leave the loss mask itself, so they leave the normalisers too: token-mean divides by the kept tokens
        of the global batch, the seq-mean modes count the rows with a kept token, and pg_clipfrac and the KL term
        are over the kept tokens. "rollout_rejected_frac" is the rejected share of the loss_mask tokens (0.0 for
        the other modes). When EVERY token is rejected the step is SKIPPED, not raised (a badly off-policy batch is
        a training event, like a non-finite norm, not a user error): no forward, no step, adapters, optimizer
        state and version unchanged, and {"loss": 0, "grad_norm": 0, "pg_clipfrac": 0, "kl": 0} (nothing is in
        the loss) with "skipped": True and "rollout_rejected_frac": 1.0. rollout_is None: no rollout correction
        (also when batch.rollout_logprobs is None).

        "sparse" (Sparse-RL, rollouts on a compressed KV cache; algos.sparse_correction with `sparse`): the ratio is
        the consistency ratio between the dense proximal recompute and the sparse sampler; sequences with a token
        below sparse.veto are rejected whole, tokens outside [sparse.lower, sparse.upper] leave the loss mask (so
        the normalisers, as "mis"), the kept tokens are weighted by the truncated, batch-normalised ratio; the
        returned metrics add algos' sparse/* (sequence rejection rate, ratio statistics).

        old_logprobs=None (one update on the batch the rollout just produced: one mini-batch, one epoch): the
        proximal policy is this update's own forward, as a forward pass before it would compute (the same adapters
        and routes): the clip ratio is 1 and the rollout correction's weights are computed per microbatch from the
        forward's detached logprobs, which saves the separate proximal pass. Only per-token or per-sequence
        truncation (or none) can be computed that way ("mis" and "sparse" change the normalisers before the
        forward: refused). proximal_out, a list: receives the LogprobResult of that forward (the logprobs the
        proximal pass would return, with the router disagreement measured under r3)."""
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
        self_proximal = old_logprobs is None
        if self_proximal and rollout_is not in ("token", "sequence", None) and batch.rollout_logprobs is not None:
            raise ValueError(f"rollout_is={rollout_is!r} needs the proximal logprobs of the whole batch before the "
                             "update: pass old_logprobs")
        if kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
        if replay == "r2" and routes is None:
            raise ValueError("replay='r2' needs routes= (the RoutesBatch recorded by logprobs(replay='record'))")
        routes = (routes if routes is not None else batch.routes) if replay != "off" else None   # checked in run
        mask = batch.loss_mask
        n_valid = int(mask.sum())
        if n_valid == 0:
            raise ValueError("loss_mask selects no token: nothing to train on")
        old = None if self_proximal else old_logprobs.float()
        weights, extra = None, {}
        if self_proximal:
            pass                                    # weights per microbatch in loss_fn, from the forward itself
        elif rollout_is == "sparse" and batch.rollout_logprobs is not None:
            mask, weights, extra = sparse_correction(old, batch.rollout_logprobs.float(), mask, sparse)
        elif rollout_is == "mis" and batch.rollout_logprobs is not None:
            mask, _ = rollout_rejection(old, batch.rollout_logprobs.float(), mask, threshold=rollout_is_threshold)
        elif rollout_is is not None and batch.rollout_logprobs is not None:
            weights, _ = rollout_correction(old, batch.rollout_logprobs.float(), mask, level=rollout_is,
                                            threshold=rollout_is_threshold)
        n_tokens = int(mask.sum())
        rejected_frac = (n_valid - n_tokens) / n_valid
        if n_tokens == 0:                           # every token rejected (mis): skip, see the docstring
            return {"loss": 0.0, "grad_norm": 0.0, "clipped": False, "skipped": True, "pg_clipfrac": 0.0, "kl": 0.0,
                    "lr": float(self.optimizer.param_groups[0]["lr"]), "rollout_rejected_frac": rejected_frac,
                    **extra}
        gb = GlobalBatch(dp_size=1, batch_num_tokens=n_tokens, global_batch_size=int((mask.sum(-1) > 0).sum()),
                         loss_scale_factor=self.loss.loss_scale_factor)     # a constant of the run, not the width
        s = batch.seq_len
        advantages = batch.advantages.float()
        rollout, valid = batch.rollout_logprobs, batch.loss_mask      # the engine-vs-update k3 (below)

        def loss_fn(logits_local, batch):          # batch: one microbatch dict (run_schedule's keyword)
            ids = batch["ids"]
            dev = logits_local.device
            lp = self._label_logprobs(logits_local, batch["tokens"], s)
            m = mask[ids].to(dev)
            w = None if weights is None else weights[ids].to(dev)
            if self_proximal:
                own = lp.detach()
                own_cpu = own.cpu()
                parts.append((ids, own_cpu))
                if rollout_is is not None and rollout is not None:
                    w = rollout_correction(own_cpu, rollout[ids].float(), mask[ids], level=rollout_is,
                                           threshold=rollout_is_threshold)[0].to(dev)
            pg, metrics = policy_loss(own if self_proximal else old[ids].to(dev), lp, advantages[ids].to(dev), m,
                                      self.loss, gb, rollout_is_weights=w)
            total, kl_loss = pg, torch.zeros((), device=dev)
            if ref_logprobs is not None:            # reported whenever given; in the loss when kl_coef > 0
                kl_loss = aggregate(kl_penalty(lp, ref_logprobs[ids].float().to(dev)), m, self.loss.loss_agg_mode, gb)
                if kl_coef > 0:
                    total = pg + kl_coef * kl_loss
            k3 = 0.0
            if rollout is not None:                 # mismatch.k3_kl's (r - 1) - log r, summed
                with torch.no_grad():
                    log_r = (lp.detach().cpu() - rollout[ids].float()).double()
                    k3 = float(((torch.expm1(log_r) - log_r) * valid[ids]).sum())
            logged = torch.tensor([float(total), float(kl_loss), metrics["actor/pg_clipfrac"] * float(m.sum()), k3],
                                  dtype=torch.float64)
            return total, torch.tensor(1, dtype=torch.int, device=dev), {"stats": logged}

        parts: list = []
        self.core.zero_grad()
        self.model.train()
        res = self._run(batch, plan, replay, routes, forward_only=False, on_output=loss_fn,
                        measure=self_proximal and proximal_out is not None)
        if self_proximal and proximal_out is not None:
            proximal_out.append(LogprobResult(self._gather_rows(batch, parts), res.disagreement, None,
                                              res.token_disagreement))
        stats = torch.zeros(4, dtype=torch.float64)
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            stats = sum((o["stats"] for o in res.outputs), stats)
        dist.all_reduce(stats)
        step = self.core.step(self.grad_clip)
        return {"loss": float(stats[0]), "grad_norm": step.grad_norm, "clipped": step.clipped,
                "skipped": step.skipped, "pg_clipfrac": float(stats[2]) / n_tokens, "kl": float(stats[1]),
                "lr": float(self.optimizer.param_groups[0]["lr"]), "rollout_rejected_frac": rejected_frac, **extra,
                **({} if rollout is None else {"update_rollout_kl": float(stats[3]) / n_valid})}

    # -- refit -----------------------------------------------------------------------------------------------------
    def push(self, transport, version: int, *, collect_to: int | None = 0, owner: str | None = None):
        """LoRA-only push of the adapters (TrainingCore.push)."""
        return self.core.push(transport, version, collect_to=collect_to, owner=owner)
