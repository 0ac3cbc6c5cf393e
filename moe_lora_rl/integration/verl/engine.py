"""Our training engine behind verl's BaseEngine contract (selected by strategy "moe_lora"): a thin adapter between
verl's engine contract and the training core the main job also calls (policy/training.py's TrainingCore).

    verl TensorDict (nested input_ids / loss_mask, optional routed_experts)
      -> verl's micro-batching (prepare_micro_batches) -> right-padded [b, S] microbatches (one shape for the PP p2p)
      -> [R3: verl routes -> one RoutesBatch, padding rows without routes] -> TrainingCore.run (queues the routes per
         microbatch, runs megatron's schedule, checks they were consumed, always leaves the replayer empty)
      -> per-token log_probs as verl's nested [bsz, j] (row t = log p(token t+1)) -> verl's loss_function
      -> verl's postprocess_batch_func (loss list, metrics, model_output in the original sample order)

The reference policy is the same model with the adapters disabled (disable_adapter). model.lora.adapter_path loads a
PEFT adapter at initialize (load_adapter); optim's Megatron lr schedule is verl's own scheduler (lr_schedule.py).
Only adapter factors train; optimizer_step is TrainingCore.step (its non-finite rule: a non-finite norm skips the
step and is returned).

PPO mini-batches are verl's: its update_actor (TrainingWorker.train_mini_batch) cuts each DP rank's share into
ppo_mini_batch_size / dp rows and calls train_batch (BaseEngine's: zero_grad, forward_backward_batch, optimizer_step)
once per mini-batch and epoch; forward_backward_batch counts the loss tokens of the batch it is handed (all-reduced
over DP), so each mini-step's loss is normalised by its mini-batch, as in verl's engines, and the version advances
once per mini-step (tests/distributed/test_verl_engine.py).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from ...megatron.forward import gather_vocab
from ...policy.logprobs import label_logprobs, padded_len, scaled_logits
from ...router_replay.routes import RoutesBatch
from .verl_config import MoELoRAEngineConfig, check_verl_version, lora_config
from .lr_schedule import build_lr_scheduler, current_lr
from .routes_dataproto import routes_from_verl


def _lora_get(lora, key):
    if lora is None:
        return None
    return lora.get(key) if hasattr(lora, "get") else getattr(lora, key, None)


class _Ctx(BaseEngineCtx):
    def __init__(self, engine, mode, **kwargs):
        super().__init__(engine, mode, **kwargs)

    def __enter__(self):
        super().__enter__()
        (self.engine.model.train if self.mode == "train" else self.engine.model.eval)()

    def __exit__(self, *exc):
        super().__exit__(*exc)


class MoELoRAEngine(BaseEngine):
    def __init__(self, model_config, engine_config: MoELoRAEngineConfig, optimizer_config=None,
                 checkpoint_config=None, **_):
        check_verl_version()
        if not isinstance(engine_config, MoELoRAEngineConfig):
            raise ValueError(f"actor_rollout_ref.actor.megatron._target_ builds {type(engine_config).__name__}; "
                             "our engine needs moe_lora_rl.integration.verl.verl_config.MoELoRAEngineConfig")
        from ...megatron.parallel import init_distributed
        from ...megatron.run_config import prepare_host

        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.lora = lora_config(model_config.lora)
        self.layout, self.rc = engine_config.layout(), engine_config.run_config()
        from ...megatron import cpu_support

        if self.rc.device == "cpu" and cpu_support.active() is None:
            prepare_host(self.rc)                      # once per process (megatron-core's CPU support)
        init_distributed(self.layout, self.rc)
        self.core = None
        self.lr_scheduler = None
        self.adapter_path = None
        self.reference_scope = False            # inside disable_adapter: the reference policy's recomputes
        self.mode = None
        self.base_sync_done = False

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def initialize(self):
        from ...policy.training import TrainingCore

        oc = self.optimizer_config
        adamw = None if self.engine_config.forward_only or oc is None else dict(
            lr=oc.lr, weight_decay=oc.weight_decay, betas=tuple(oc.betas))
        self.core = TrainingCore(self.model_config.local_path, self.layout, self.rc, self.lora, adamw=adamw,
                                 override_transformer_config=self.engine_config.override_transformer_config)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, oc)
        path = _lora_get(self.model_config.lora, "adapter_path")
        if path:
            self.load_adapter(path)

    def load_adapter(self, path: str) -> None:
        """lora.adapter_path: a PEFT adapter directory (our export or PEFT's own save_pretrained; refit/peft_dir.py)
        checked against model.lora and the model, then every rank's slice copied into the adapters (collective). It
        is the starting policy: version 0, what the first weight sync sends; the optimizer state stays empty; a
        later load_checkpoint (a resumed run) replaces it."""
        from ...refit.peft_dir import load_adapter_dir

        load_adapter_dir(self.model, self.arch, path, self.lora, self.model_config.local_path)
        self.core.version = 0
        self.adapter_path = str(path)

    # the core's state, under the names verl's callers and our weight sync use (None before initialize)
    model = property(lambda self: self.core and self.core.model)
    arch = property(lambda self: self.core and self.core.arch)
    optimizer = property(lambda self: self.core and self.core.optimizer)
    replayer = property(lambda self: self.core and self.core.replayer)

    @property
    def version(self) -> int:
        return self.core.version if self.core is not None else 0

    @version.setter
    def version(self, v: int) -> None:
        self.core.version = int(v)

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return _Ctx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _Ctx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model, optimizer, grad)       # the model stays where it was built

    @contextlib.contextmanager
    def disable_adapter(self):
        """The reference policy: every adapter's contribution scaled by 0 (exactly the base model's output). Its
        recomputes are not the rollout policy's: the in-run R3 check leaves them out."""
        with self.core.adapters(False):
            self.reference_scope = True
            try:
                yield
            finally:
                self.reference_scope = False

    # -- parallel info ---------------------------------------------------------------------------------------------
    def get_data_parallel_rank(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    def get_data_parallel_size(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self):
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage()

    # -- optimizer -------------------------------------------------------------------------------------------------
    def optimizer_zero_grad(self):
        self.core.zero_grad()

    def optimizer_step(self):
        """TrainingCore.step: adapter grads summed over the groups their sharding names, then divided by the
        data-parallel size (verl's losses are scaled by it, as for megatron's DP-averaging DDP); the global norm
        counts each unique shard once; clipped to optim.clip_grad. Returns the norm before clipping (verl's
        contract); a non-finite norm skips the step (grads dropped, version unchanged, core.last_step.skipped)."""
        clip = getattr(self.optimizer_config, "clip_grad", None) or 0.0
        return self.core.step(float(clip), grad_divisor=self.get_data_parallel_size()).grad_norm

    def lr_scheduler_step(self):
        """verl's Megatron engine's: the scheduler one step on (lr_schedule.py; none: the lr is constant), then the
        lr the next optimizer step uses."""
        if self.optimizer is None:
            return None
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(1)
        return current_lr(self.optimizer)

    # -- forward / backward ----------------------------------------------------------------------------------------
    def _verl_routes(self, micro_batch, lengths):
        re = micro_batch.get("routed_experts", None)
        if re is None:
            raise ValueError("router_replay.mode=R3 but the batch has no routed_experts (set "
                             "actor_rollout_ref.rollout.enable_rollout_routing_replay=True)")
        per = list(re.unbind()) if re.is_nested else [re[i] for i in range(re.shape[0])]
        return routes_from_verl(per, lengths, num_layers=self.arch.num_layers, moe_layer_ids=self.arch.moe_layer_ids,
                                num_experts=self.arch.num_experts, topk=self.arch.topk)

    def forward_backward_batch(self, data, loss_function: Callable | None, forward_only=False):
        replay = self.engine_config.router_replay.mode == "R3" and \
            tu.get_non_tensor_data(data, "enable_routing_replay", False)
        out = self._run_batch(data, loss_function, forward_only, replay)
        if forward_only and replay and self.engine_config.r3_check_log and "rollout_log_probs" in data.keys() \
                and not self.reference_scope:
            from .r3_check import record, shifted_routes

            # every pipeline stage runs the check's two passes (the last stage receives their activations); only
            # the last stage has log-probs (`out`) to record
            free = self._run_batch(data, None, True, False)
            shifted = self._run_batch(shifted_routes(data), None, True, True)
            if out:
                record(self.engine_config.r3_check_log, data, out, free, shifted, version=self.version)
        return out

    def _run_batch(self, data, loss_function, forward_only: bool, replay: bool):
        import torch.distributed as dist

        loss_mask = data["loss_mask"]
        n_tok = (loss_mask.values().sum() if loss_mask.is_nested else loss_mask.sum()).to(torch.int64)
        dist.all_reduce(n_tok, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=int(n_tok), dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group(),
                                                       same_micro_num_in_dp=True)
        n_micro = len(micro_batches)
        lengths = [[int(n) for n in mb["input_ids"].offsets().diff().tolist()] for mb in micro_batches]
        s = padded_len(max(max(l) for l in lengths), self.core.view)     # sequence parallelism splits S over TP
        b = max(len(l) for l in lengths)
        packed, samples, rows, route_lengths, routes = [], [], [], [], None
        for mb, lens in zip(micro_batches, lengths):
            tu.assign_non_tensor(mb, num_micro_batch=n_micro)
            tokens = torch.zeros(b, s, dtype=torch.long)
            for i, seq in enumerate(mb["input_ids"].unbind()):
                tokens[i, : lens[i]] = seq.cpu()
            packed.append({"tokens": tokens, "mb": mb, "lengths": lens})
            if replay:                  # one RoutesBatch over every microbatch; padding rows: no routes (spread)
                routes = self._verl_routes(mb, lens)
                rows.append(list(range(len(samples), len(samples) + b)))
                samples += routes.samples + [routes.samples[0][:0]] * (b - len(lens))
                route_lengths += lens + [1] * (b - len(lens))
        if replay:
            routes = RoutesBatch(samples, routes.layer_ids, routes.num_experts, routes.topk)
        vocab = self.arch.vocab_size
        dp_group = self.get_data_parallel_group()

        def on_output(logits_local, batch):
            mb, lens = batch["mb"], batch["lengths"]
            temp = tu.get(mb, "temperature", 1.0)
            temp = torch.as_tensor(temp, dtype=torch.float32).reshape(-1)
            temp = (temp if temp.numel() > 1 else temp.expand(len(lens))).clamp_min(1e-8)
            logits = scaled_logits(logits_local, torch.cat([temp, torch.ones(b - len(lens))]))   # per row
            lp = label_logprobs(logits, batch["tokens"], vocab)                                 # [b, s]
            rows = [torch.cat([lp[i, : n - 1], lp.new_zeros(1)]) for i, n in enumerate(lens)]
            model_output = {"log_probs": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}
            if tu.get_non_tensor_data(mb, "calculate_entropy", False):
                full = gather_vocab(logits, vocab)                               # [b, s, V], autograd-aware
                ent = torch.logsumexp(full, -1) - (torch.softmax(full, -1) * full).sum(-1)
                model_output["entropy"] = torch.nested.as_nested_tensor(
                    [torch.cat([ent[i, : n - 1], ent.new_zeros(1)]) for i, n in enumerate(lens)], layout=torch.jagged)
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=mb, dp_group=dp_group)
            else:
                loss, metrics = torch.zeros((), device=logits.device), {}
            out = {"loss": float(loss.detach()), "metrics": metrics,
                   "model_output": {k: v.detach() for k, v in model_output.items()}}
            if forward_only:
                return out
            return loss * n_micro, out

        outs = self.core.run(packed, forward_only=forward_only, on_output=on_output, seq_length=s, micro_batch_size=b,
                             replay="replay" if replay else "off", routes=routes, rows=rows,
                             lengths=route_lengths).outputs
        from megatron.core import parallel_state as ps

        if not ps.is_pipeline_last_stage():
            return {}
        return postprocess_batch_func(output_lst=outs, indices=indices, data=data)

    # -- weight sync -----------------------------------------------------------------------------------------------
    def get_per_tensor_param(self, layered_summon=False, base_sync_done=None, **kwargs):
        from .weight_sync import per_tensor_params

        return per_tensor_params(self, base_sync_done)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def _run_meta(self) -> dict:
        from ...checkpoint.api import describe_run

        return describe_run(self.model_config.local_path, self.lora, self.layout)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """Adapters and the AdamW state (our layout-independent checkpoint, rl/checkpoint.py) under LOCAL_PATH/step-N,
        with the adapter version and the lr scheduler's state; loadable at any layout. max_ckpt_to_keep: older steps
        under LOCAL_PATH removed."""
        from ...checkpoint.api import prune, save_checkpoint

        if hdfs_path:
            raise ValueError(f"hdfs_path={hdfs_path!r}: our engine saves to local_path only")
        state = {"version": self.version}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        save_checkpoint(local_path, int(global_step), self.model, self.optimizer, run_meta=self._run_meta(),
                        state=state)
        if max_ckpt_to_keep:
            prune(local_path, int(max_ckpt_to_keep))

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """The latest step under LOCAL_PATH into the adapters and the optimizer (refused, nothing changed, if the
        model or the LoRA config differ); the adapter version and the lr schedule continue from the saved ones (the
        schedule's position always; its settings from the config unless optim.use_checkpoint_opt_param_scheduler,
        megatron-core's rule. verl's own Megatron engine restores the schedule only with that key set)."""
        from ...checkpoint.api import load_checkpoint

        state = load_checkpoint(local_path, self.model, self.optimizer, run_meta=self._run_meta())
        self.version = int(state["version"])
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.num_steps = 0                 # load_state_dict steps by the saved count
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
