"""Our training engine behind verl's BaseEngine contract (selected by strategy "moe_lora"):

    verl TensorDict (nested input_ids / loss_mask, optional routed_experts)
      -> verl's micro-batching (prepare_micro_batches) -> right-padded [b, S] microbatches (one shape for the PP p2p)
      -> [R3: verl routes -> RoutesBatch -> align_microbatch -> each router's replay queue]
      -> our Megatron model (build_from_hf + expert LoRA) through megatron's schedule
      -> per-token log_probs as verl's nested [bsz, j] (row t = log p(token t+1)) -> verl's loss_function
      -> verl's postprocess_batch_func (loss list, metrics, model_output in the original sample order)

The reference policy is the same model with the adapters disabled (disable_adapter). Only adapter factors train.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from ...megatron.forward import gather_vocab, run_schedule
from ...megatron.train_step import token_log_probs
from .config import MoELoRAEngineConfig, check_verl_version, lora_config
from .routes import routes_from_verl

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
                             "our engine needs moe_lora_rl.integration.verl.config.MoELoRAEngineConfig")
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
        self.model = self.arch = self.optimizer = self.replayer = None
        self.mode = None
        self.version = 0
        self.base_sync_done = False

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def initialize(self):
        from ...lora.layers import adapter_factors
        from ...policy.model import build_from_hf
        from ...router_replay.replay import RouterReplayer

        self.arch, self.model = build_from_hf(self.model_config.local_path, self.layout, self.rc, lora=self.lora)
        params = [p for _, p in adapter_factors(self.model)]
        oc = self.optimizer_config
        self.optimizer = None if self.engine_config.forward_only or oc is None else torch.optim.AdamW(
            params, lr=oc.lr, weight_decay=oc.weight_decay, betas=tuple(oc.betas))
        if self.engine_config.router_replay.mode == "R3":
            self.replayer = RouterReplayer(self.model)

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
        """The reference policy: every adapter's contribution scaled by 0 (exactly the base model's output)."""
        from ...lora.layers import LoRAAdapter

        adapters = [m for m in self.model.modules() if isinstance(m, LoRAAdapter)]
        scales = [a.scale for a in adapters]
        try:
            for a in adapters:
                a.scale = 0.0
            yield
        finally:
            for a, s in zip(adapters, scales):
                a.scale = s

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
        from ...lora.layers import adapter_factors

        for _, p in adapter_factors(self.model):
            p.grad = None

    def optimizer_step(self):
        """Adapter grads summed over the groups their sharding names, then divided by the data-parallel size (verl's
        losses are scaled by it, as for megatron's DP-averaging DDP); the global norm counts each unique shard once
        (sum of squares over the owners, summed over the world); clipped to optim.clip_grad."""
        import torch.distributed as dist

        from ...lora.grad_sync import sync_adapter_grads
        from ...lora.layers import adapter_factors
        from ...lora.state import is_owner

        sync_adapter_grads(self.model)
        params = [p for _, p in adapter_factors(self.model)]
        dp = self.get_data_parallel_size()
        if dp > 1:                  # verl scales each rank's loss by dp_size (for DP-averaging DDP); we sum
            for p in params:
                p.grad.div_(dp)
        sq = torch.zeros((), dtype=torch.float64)
        for p in params:
            if is_owner(p.lora_meta):
                sq += p.grad.double().pow(2).sum().cpu()
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        clip = getattr(self.optimizer_config, "clip_grad", None)
        if clip and norm > clip:
            for p in params:
                p.grad.mul_(clip / (norm + 1e-6))
        if not torch.isfinite(torch.tensor(norm)):
            return norm
        self.optimizer.step()
        self.version += 1
        return norm

    def lr_scheduler_step(self):
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else None

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
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from ...router_replay.align import align_microbatch
        from ...router_replay.replay import Mode

        loss_mask = data["loss_mask"]
        n_tok = (loss_mask.values().sum() if loss_mask.is_nested else loss_mask.sum()).to(torch.int64)
        dist.all_reduce(n_tok, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=int(n_tok), dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group(),
                                                       same_micro_num_in_dp=True)
        n_micro = len(micro_batches)
        replay = self.replayer is not None and tu.get_non_tensor_data(data, "enable_routing_replay", False)
        lengths = [[int(n) for n in mb["input_ids"].offsets().diff().tolist()] for mb in micro_batches]
        tp = ps.get_tensor_model_parallel_world_size()
        s = max(max(l) for l in lengths)
        s = -(-s // tp) * tp                               # sequence parallelism splits S over TP
        b = max(len(l) for l in lengths)
        packed = []
        for mb, lens in zip(micro_batches, lengths):
            tu.assign_non_tensor(mb, num_micro_batch=n_micro)
            tokens = torch.zeros(b, s, dtype=torch.long)
            for i, seq in enumerate(mb["input_ids"].unbind()):
                tokens[i, : lens[i]] = seq.cpu()
            packed.append({"tokens": tokens, "mb": mb, "lengths": lens})
            if replay:
                routes = self._verl_routes(mb, lens)
                routes.samples += [routes.samples[0][:0]] * (b - len(lens))       # padding rows: spread routes
                self.replayer.queue_microbatch(align_microbatch(
                    routes, list(range(b)), padded_len=s, stage_layers=self.replayer.layer_ids,
                    tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                    sequence_parallel=self.model.config.sequence_parallel))
        if self.replayer is not None:
            self.replayer.set_mode(Mode.REPLAY if replay else Mode.DISABLED)
        vocab = self.arch.vocab_size
        dp_group = self.get_data_parallel_group()

        def on_output(logits_local, batch):
            mb, lens = batch["mb"], batch["lengths"]
            temp = tu.get(mb, "temperature", 1.0)
            temp = torch.as_tensor(temp, dtype=torch.float32).reshape(-1)
            temp = (temp if temp.numel() > 1 else temp.expand(len(lens))).clamp_min(1e-8)
            temp = torch.cat([temp, torch.ones(b - len(lens))]).to(logits_local.device)
            logits = logits_local.float() / temp[:, None, None]
            labels = torch.roll(batch["tokens"], -1, dims=1).to(logits.device)
            lp = token_log_probs(logits, labels, vocab)                      # [b, s]
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

        try:
            outs = run_schedule(self.model, packed, forward_only=forward_only, on_output=on_output, seq_length=s,
                                micro_batch_size=b)
            if replay:
                self.replayer.check_consumed()
        finally:
            if self.replayer is not None:
                self.replayer.set_mode(Mode.DISABLED)
                for r in self.replayer.replays:
                    r.queue.clear()
                    r.recompute_queue.clear()
        if not ps.is_pipeline_last_stage():
            return {}
        return postprocess_batch_func(output_lst=list(outs), indices=indices, data=data)

    # -- weight sync -----------------------------------------------------------------------------------------------
    def get_per_tensor_param(self, layered_summon=False, base_sync_done=None, **kwargs):
        from .weight_sync import per_tensor_params

        return per_tensor_params(self, base_sync_done)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def _run_meta(self) -> dict:
        from ...checkpoint.store import describe_run

        return describe_run(self.model_config.local_path, self.lora, self.layout)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """Adapters and the AdamW state (our layout-independent checkpoint, rl/checkpoint.py) under LOCAL_PATH/step-N,
        with the adapter version; loadable at any layout. max_ckpt_to_keep: older steps under LOCAL_PATH removed."""
        from ...checkpoint.store import prune, save_checkpoint

        if hdfs_path:
            raise ValueError(f"hdfs_path={hdfs_path!r}: our engine saves to local_path only")
        save_checkpoint(local_path, int(global_step), self.model, self.optimizer, run_meta=self._run_meta(),
                        state={"version": self.version})
        if max_ckpt_to_keep:
            prune(local_path, int(max_ckpt_to_keep))

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """The latest step under LOCAL_PATH into the adapters and the optimizer (refused, nothing changed, if the
        model or the LoRA config differ); the adapter version continues from the saved one."""
        from ...checkpoint.store import load_checkpoint

        state = load_checkpoint(local_path, self.model, self.optimizer, run_meta=self._run_meta())
        self.version = int(state["version"])
