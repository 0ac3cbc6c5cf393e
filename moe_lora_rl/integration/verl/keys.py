"""Every key of verl 0.9.1's actor_rollout_ref sections (model, actor, ref, rollout) and what our override does with
it: one table, read by `config.check_keys` (over `key_refusals`) before Ray starts and printed in docs/verl.md (`python -m
moe_lora_rl.integration.verl.keys` writes the Markdown). No key is dropped without a word: a key is honoured (by our
engine or replica, or by verl's own code that runs unchanged around them), honoured for some values only (others are
refused in one line naming the key and what to do), or, for a key verl's Megatron path does not read either, held to
its default. A key missing from the table is refused too (tests/unit/test_verl_keys.py walks verl's whole composed
config and fails on any key the table does not cover).

    Key(path, how, why, allowed)
      path     relative to actor_rollout_ref; "a.b.*" covers the subtree a.b (the longest matching path wins)
      how      OURS     our engine or replica reads it and does what verl's Megatron path does with it
               VERL     verl's own code around our engine reads it (its micro-batching, losses, agent loop, vLLM
                        server arguments, trainer loop): unchanged behaviour
               ONLY     honoured for the values in `allowed` only; any other value is refused with `why`
               ACTOR    ref.megatron.*: must equal the actor's value (with LoRA the reference policy is the actor's
                        model with the adapters off, verl's ref_in_actor; a separate layout would be dropped)
This module imports no verl.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OURS, VERL, ONLY, ACTOR = "ours", "verl", "only", "actor"


@dataclass(frozen=True)
class Key:
    path: str
    how: str
    why: str
    allowed: tuple = ()


def _only(path, allowed, why):
    return Key(path, ONLY, why, tuple(allowed) if isinstance(allowed, (tuple, list)) else (allowed,))


def _empty(path, why):
    """PATH must stay an empty mapping: the row for it and the one refusing any key under it."""
    return Key(path, ONLY, why, ({},)), Key(path + ".*", ONLY, why, ())


_FSDP = "verl's FSDP key (its Megatron path does not read it)"
_PROFILER = "verl's profiler (its own code around our engine)"

TABLE: tuple[Key, ...] = (
    # -- model ---------------------------------------------------------------------------------------------------
    Key("model._target_", VERL, "verl's HFModelConfig (tokenizer, local copy of the checkpoint)"),
    *_empty("model.override_config", "our model is built from model.path's config.json as it is: remove it"),
    Key("model.path", OURS, "the HF checkpoint our Megatron model and vLLM engine are built from"),
    _only("model.hf_config_path", None, "our model is built from model.path's config.json: remove it"),
    Key("model.tokenizer_path", VERL, "verl's tokenizer (data and agent loop)"),
    Key("model.use_shm", VERL, "verl copies the checkpoint to shared memory; our engine reads that copy"),
    Key("model.trust_remote_code", VERL, "verl's tokenizer; our model builder reads the family tables"),
    Key("model.custom_chat_template", VERL, "verl's chat template for prompts"),
    Key("model.external_lib", OURS, "must include moe_lora_rl.integration.verl.plugin (it registers our names)"),
    Key("model.enable_gradient_checkpointing", VERL, _FSDP + " (accepted, no effect there either); Megatron's "
        "recompute is actor.megatron.override_transformer_config.recompute_*"),
    _only("model.enable_activation_offload", False, _FSDP + ": remove it"),
    Key("model.use_remove_padding", VERL, "verl's packing of micro-batches (our engine re-pads each to one shape)"),
    _only("model.lora_rank", 0, "verl's FSDP LoRA: use actor_rollout_ref.model.lora.rank"),
    _only("model.lora_alpha", 16, "verl's FSDP LoRA: use actor_rollout_ref.model.lora.alpha"),
    _only("model.target_modules", "all-linear", "verl's FSDP LoRA: use actor_rollout_ref.model.lora.target_modules"),
    _only("model.exclude_modules", (None,), "verl's FSDP LoRA: use actor_rollout_ref.model.lora.target_modules"),
    _only("model.lora_adapter_path", None, "verl's FSDP LoRA: use actor_rollout_ref.model.lora.adapter_path"),
    _only("model.use_liger", False, _FSDP + ": remove it"),
    Key("model.use_fused_kernels", OURS, "our engine computes the log-probs and entropy verl's fused kernels compute "
        "(exact, on the vocab shards), with or without the flag"),
    Key("model.fused_kernel_options.*", OURS, "see use_fused_kernels"),
    _only("model.tiled_mlp.enabled", False, _FSDP + ": remove it"),
    Key("model.tiled_mlp.num_shards", VERL, "read only with tiled_mlp.enabled (refused)"),
    _only("model.mtp.enable", False, "MTP layers are not trained or served by our engine: remove it"),
    _only("model.mtp.enable_train", False, "MTP layers are not trained by our engine: remove it"),
    _only("model.mtp.enable_rollout", False, "speculative decoding with MTP is not served by our replica: remove it"),
    Key("model.mtp.*", VERL, "read only with mtp.enable (refused)"),
    Key("model.lora.rank", OURS, "adapter rank (a positive integer)"),
    Key("model.lora.alpha", OURS, "adapter scale alpha / rank"),
    Key("model.lora.dropout", OURS, "dropout on the adapter input, training forward only"),
    Key("model.lora.target_modules", OURS, "Megatron module names (or ours) mapped to our targets; verl's default "
        "list and all-linear mean every linear"),
    _only("model.lora.exclude_modules", (None, ()), "name what to adapt in model.lora.target_modules"),
    _only("model.lora.type", "lora", "our engine trains plain LoRA (per-expert, shared_outer or shared: "
          "+model.lora.adapter_layout)"),
    _only("model.lora.merge", False, "our replica serves the adapters unmerged (LoRA-only refit)"),
    _only("model.lora.dropout_position", "pre", "our LoRA applies dropout to the adapter input (pre), as PEFT does"),
    _only("model.lora.lora_A_init_method", ("xavier", "kaiming"), "A's init: xavier-uniform (verl's default, as "
          "Megatron-Bridge draws it) or kaiming-uniform (PEFT's; our recipe config's); other methods are not "
          "implemented"),
    _only("model.lora.lora_B_init_method", "zero", "B starts at zero (the adapted model equals the base at step 0)"),
    _only("model.lora.a2a_experimental", False, "Megatron-Bridge's experimental all-to-all LoRA: remove it"),
    _only("model.lora.dtype", (None, "float32", "fp32"), "adapters and their AdamW state are kept in fp32 whatever "
          "the model's dtype: remove it or set float32"),
    Key("model.lora.adapter_path", OURS, "a PEFT adapter folder loaded into the sharded adapters at start (rank, "
        "alpha, targets and model checked first)"),
    Key("model.lora.freeze_vision_model", VERL, "vision towers are not built by our engine (text models only)"),
    Key("model.lora.freeze_vision_projection", VERL, "vision towers are not built by our engine (text models only)"),
    _only("model.lora.freeze_language_model", True, "the base language model stays frozen (LoRA only)"),
    Key("model.lora.targets", OURS, "ours: experts, attention, dense_mlp, shared_experts, all (or target_modules)"),
    Key("model.lora.adapter_layout", OURS, "ours: per_expert | shared_outer | shared"),
    Key("model.lora.init_seed", OURS, "ours: the adapters' init seed"),
    # -- actor ---------------------------------------------------------------------------------------------------
    Key("actor._target_", VERL, "verl's McoreActorConfig"),
    Key("actor.rollout_n", VERL, "verl's group size"),
    _only("actor.strategy", "megatron", "keep megatron: verl then reads actor.megatron (our engine config)"),
    Key("actor.ppo_mini_batch_size", VERL, "verl's mini-batching (one optimizer step each)"),
    Key("actor.ppo_micro_batch_size", VERL, "verl's micro-batching"),
    Key("actor.ppo_micro_batch_size_per_gpu", VERL, "verl's micro-batching"),
    Key("actor.use_dynamic_bsz", VERL, "verl's token-budget micro-batching (prepare_micro_batches)"),
    Key("actor.ppo_max_token_len_per_gpu", VERL, "verl's token-budget micro-batching"),
    Key("actor.clip_ratio", VERL, "verl's policy loss"),
    Key("actor.clip_ratio_low", VERL, "verl's policy loss"),
    Key("actor.clip_ratio_high", VERL, "verl's policy loss"),
    Key("actor.clip_ratio_c", VERL, "verl's policy loss"),
    Key("actor.tau_pos", VERL, "verl's policy loss"),
    Key("actor.tau_neg", VERL, "verl's policy loss"),
    Key("actor.freeze_vision_tower", VERL, "no vision tower is built by our engine"),
    Key("actor.policy_loss.*", VERL, "verl's policy loss"),
    Key("actor.loss_agg_mode", VERL, "verl's loss aggregation (seq-mean-token-sum-norm needs loss_scale_factor)"),
    Key("actor.loss_scale_factor", VERL, "verl's loss aggregation"),
    Key("actor.entropy_coeff", VERL, "verl's loss (entropy from our engine when asked)"),
    Key("actor.calculate_entropy", VERL, "our engine returns entropy when verl asks"),
    _only("actor.calculate_sum_pi_squared", False, "our engine does not return sum(pi^2): remove it"),
    Key("actor.use_kl_loss", VERL, "verl's KL loss against the reference (our engine with the adapters off)"),
    Key("actor.kl_loss_coef", VERL, "verl's KL loss"),
    Key("actor.kl_loss_type", VERL, "verl's KL loss"),
    _only("actor.use_prefix_grouper", False, "verl's prefix grouper needs its own attention path: remove it"),
    Key("actor.use_torch_compile", VERL, _FSDP + " (accepted: no effect in verl's Megatron path either)"),
    Key("actor.use_rollout_log_probs", VERL, "verl's fully-async trainer: the rollout's log-probs as the old policy's"),
    Key("actor.ppo_epochs", VERL, "verl's update loop"),
    Key("actor.shuffle", VERL, "verl's update loop"),
    Key("actor.data_loader_seed", VERL, "verl's update loop"),
    Key("actor.checkpoint._target_", VERL, "verl's checkpoint config"),
    _only("actor.checkpoint.save_contents", (("model", "optimizer", "extra"),), "our checkpoint always holds the "
          "adapters, their AdamW state and the lr schedule: keep verl's default"),
    *_empty("actor.checkpoint.mbridge_config", "our checkpoints are written without Megatron-Bridge: remove it"),
    Key("actor.checkpoint.load_contents", VERL, "follows save_contents"),
    _only("actor.checkpoint.async_save", False, "our checkpoint is written synchronously: remove it"),
    _only("actor.checkpoint.strict", True, "a checkpoint of another model or LoRA config is always refused"),
    Key("actor.use_fused_kernels", OURS, "see model.use_fused_kernels"),
    Key("actor.profiler.*", VERL, _PROFILER),
    _only("actor.qat.enable", False, "quantization-aware training is not supported by our engine: remove it"),
    Key("actor.qat.*", VERL, "read only with qat.enable (refused)"),
    Key("actor.entropy_from_logits_with_chunking", VERL, "a memory option of verl's entropy; ours is exact "
        "either way"),
    Key("actor.entropy_from_logits_chunk_size", VERL, "see entropy_from_logits_with_chunking"),
    # -- actor.optim (verl's McoreOptimizerConfig) -------------------------------------------------------------------
    Key("actor.optim._target_", VERL, "verl's McoreOptimizerConfig"),
    *_empty("actor.optim.override_optimizer_config", "our engine's optimizer is AdamW on the adapters: remove it"),
    Key("actor.optim.lr", OURS, "AdamW learning rate (the schedule's peak)"),
    Key("actor.optim.weight_decay", OURS, "AdamW weight decay"),
    Key("actor.optim.betas", OURS, "AdamW betas"),
    Key("actor.optim.clip_grad", OURS, "global grad-norm clip over every adapter shard"),
    _only("actor.optim.optimizer", "adam", "our engine trains the adapters with AdamW: remove it"),
    Key("actor.optim.lr_warmup_steps_ratio", OURS, "megatron-core's OptimizerParamScheduler, built as verl builds it"),
    Key("actor.optim.total_training_steps", OURS, "set by verl's trainer; the schedule's length"),
    Key("actor.optim.lr_warmup_steps", OURS, "see lr_warmup_steps_ratio"),
    Key("actor.optim.lr_warmup_init", OURS, "see lr_warmup_steps_ratio"),
    Key("actor.optim.lr_decay_steps", OURS, "see lr_warmup_steps_ratio"),
    Key("actor.optim.lr_decay_style", OURS, "see lr_warmup_steps_ratio"),
    Key("actor.optim.min_lr", OURS, "see lr_warmup_steps_ratio"),
    Key("actor.optim.weight_decay_incr_style", OURS, "see lr_warmup_steps_ratio"),
    Key("actor.optim.lr_wsd_decay_style", OURS, "see lr_warmup_steps_ratio"),
    Key("actor.optim.lr_wsd_decay_steps", OURS, "see lr_warmup_steps_ratio"),
    Key("actor.optim.use_checkpoint_opt_param_scheduler", OURS, "either value: our checkpoint always holds the "
        "schedule and a resume continues it"),
    _only("actor.optim.use_precision_aware_optimizer", False, "the adapters' AdamW state is fp32: remove it"),
    _only("actor.optim.main_grads_dtype", "fp32", "adapter grads are fp32"),
    _only("actor.optim.exp_avg_dtype", "fp32", "the adapters' AdamW moments are fp32"),
    _only("actor.optim.exp_avg_sq_dtype", "fp32", "the adapters' AdamW moments are fp32"),
    _only("actor.optim.use_layer_wise_distributed_optimizer", False, "adapter optimizer state is replicated per "
          "shard (it is small): remove it"),
    Key("actor.optim.muon_*", VERL, "read only with optimizer=muon (refused)"),
    # -- actor.megatron (our MoELoRAEngineConfig) -------------------------------------------------------------------
    Key("actor.megatron._target_", OURS, "must be moe_lora_rl.integration.verl.plugin.MoELoRAEngineConfig"),
    Key("actor.megatron.strategy", OURS, "our backend's name (moe_lora)"),
    Key("actor.megatron.device", OURS, "ours: cuda, or cpu (gloo)"),
    Key("actor.megatron.r3_check_log", OURS, "ours: the in-run R3 check's JSON-lines file"),
    _only("actor.megatron.param_offload", False, "the frozen base stays on the device (offloading it between steps "
          "is not implemented): remove it"),
    _only("actor.megatron.optimizer_offload", False, "the adapters' AdamW state is small and stays on the device: "
          "remove it"),
    _only("actor.megatron.grad_offload", False, "adapter grads are small and stay on the device: remove it"),
    Key("actor.megatron.tensor_model_parallel_size", OURS, "TP"),
    Key("actor.megatron.expert_model_parallel_size", OURS, "EP"),
    Key("actor.megatron.expert_tensor_parallel_size", OURS, "ETP; unset (null) follows megatron-core: ETP = TP"),
    Key("actor.megatron.pipeline_model_parallel_size", OURS, "PP"),
    _only("actor.megatron.virtual_pipeline_model_parallel_size", (None, 1), "interleaved pipelines are not "
          "supported: remove it"),
    _only("actor.megatron.context_parallel_size", 1, "context parallelism is not supported by our engine: set 1 "
          "(shorter sequences per rank come from TP with sequence parallelism)"),
    _only("actor.megatron.sequence_parallel", True, "our engine runs sequence parallelism whenever TP > 1 (and none "
          "at TP 1): keep verl's default"),
    Key("actor.megatron.use_distributed_optimizer", VERL, "accepted: the adapters' optimizer state is replicated "
        "per shard either way (it is small)"),
    _only("actor.megatron.use_dist_checkpointing", False, "our checkpoints are layout-independent already: remove it"),
    _only("actor.megatron.dist_checkpointing_path", None, "the base is read from model.path: remove it"),
    _only("actor.megatron.dynamic_context_parallel", False, "context parallelism is not supported: remove it"),
    Key("actor.megatron.max_seqlen_per_dp_cp_rank", VERL, "read only with dynamic_context_parallel (refused)"),
    Key("actor.megatron.dist_checkpointing_prefix", VERL, "read only with use_dist_checkpointing (refused)"),
    Key("actor.megatron.dist_ckpt_optim_fully_reshardable", VERL, "read only with use_dist_checkpointing (refused)"),
    Key("actor.megatron.distrib_optim_fully_reshardable_mem_efficient", VERL, "read only with "
        "use_dist_checkpointing (refused)"),
    Key("actor.megatron.entropy_from_logits_with_chunking", VERL, "see actor.entropy_from_logits_with_chunking"),
    Key("actor.megatron.entropy_from_logits_chunk_size", VERL, "see actor.entropy_from_logits_with_chunking"),
    Key("actor.megatron.seed", VERL, "verl seeds the worker; adapter init uses model.lora.init_seed"),
    Key("actor.megatron.override_transformer_config.*", OURS, "megatron-core options: each honoured or refused in one "
        "line by megatron/moe_options.py (before Ray starts)"),
    *_empty("actor.megatron.override_ddp_config", "adapter grads are reduced by our training core (no DDP): "
            "remove it"),
    *_empty("actor.megatron.override_mcore_model_config", "our engine builds the model from model.path: remove it"),
    Key("actor.megatron.use_mbridge", VERL, "accepted: our engine builds the model itself (no Megatron-Bridge)"),
    Key("actor.megatron.vanilla_mbridge", VERL, "accepted: our engine builds the model itself (no Megatron-Bridge)"),
    Key("actor.megatron.use_remove_padding", VERL, "verl's packing (our engine re-pads each micro-batch)"),
    Key("actor.megatron.pad_bshd_to_minibatch_max", VERL, "accepted: our engine pads each batch to one shape itself"),
    _only("actor.megatron.pad_to_length", False, "router replay is incompatible with pad_to_length (verl's own "
          "rule): remove it"),
    Key("actor.megatron.pad_to_length_bucket", VERL, "read only with pad_to_length (refused)"),
    _only("actor.megatron.use_megatron_fsdp", False, "Megatron FSDP is not supported by our engine: remove it"),
    Key("actor.megatron.forward_only", OURS, "set by verl for forward-only engines (no optimizer)"),
    _only("actor.megatron.dtype", ("bfloat16", "float32"), "bfloat16 or float32 (float16 is not supported)"),
    Key("actor.megatron.router_replay._target_", VERL, "verl's EngineRouterReplayConfig"),
    _only("actor.megatron.router_replay.mode", ("disabled", "R3"), "disabled or R3 (R2 records the trainer's own "
          "routes, which our R3 check measures instead)"),
    _only("actor.megatron.router_replay.record_file", None, "not read by verl either: remove it"),
    _only("actor.megatron.router_replay.replay_file", None, "not read by verl either: remove it"),
    _only("actor.megatron.qat.enable", False, "quantization-aware training is not supported: remove it"),
    Key("actor.megatron.qat.*", VERL, "read only with qat.enable (refused)"),
    # -- ref -----------------------------------------------------------------------------------------------------
    Key("ref.rollout_n", VERL, "verl's group size"),
    _only("ref.strategy", "megatron", "keep megatron"),
    Key("ref.use_torch_compile", VERL, _FSDP + " (accepted: no effect in verl's Megatron path either)"),
    Key("ref.log_prob_micro_batch_size", VERL, "verl's micro-batching of the reference pass"),
    Key("ref.log_prob_micro_batch_size_per_gpu", VERL, "verl's micro-batching of the reference pass"),
    Key("ref.log_prob_use_dynamic_bsz", VERL, "verl's token-budget micro-batching"),
    Key("ref.log_prob_max_token_len_per_gpu", VERL, "verl's token-budget micro-batching"),
    Key("ref.profiler.*", VERL, _PROFILER),
    Key("ref._target_", VERL, "verl's McoreActorConfig"),
    Key("ref.entropy_from_logits_with_chunking", VERL, "see actor.entropy_from_logits_with_chunking"),
    Key("ref.entropy_from_logits_chunk_size", VERL, "see actor.entropy_from_logits_with_chunking"),
    Key("ref.megatron.*", ACTOR, "the reference is the actor's model with the adapters off (verl's ref_in_actor "
        "with LoRA): its megatron settings must equal actor.megatron's"),
    Key("ref.megatron._target_", VERL, "verl's engine config of a separate reference (not built with LoRA)"),
    Key("ref.megatron.forward_only", VERL, "verl's"),
    Key("ref.megatron.param_offload", VERL, "a separate reference is not built with LoRA (ref_in_actor)"),
    Key("ref.megatron.optimizer_offload", VERL, "a separate reference is not built with LoRA (ref_in_actor)"),
    Key("ref.megatron.grad_offload", VERL, "a separate reference is not built with LoRA (ref_in_actor)"),
    Key("ref.megatron.use_distributed_optimizer", VERL, "a reference has no optimizer"),
    Key("ref.megatron.sequence_parallel", VERL, "follows the actor's (ref_in_actor)"),
    Key("ref.megatron.pad_bshd_to_minibatch_max", VERL, "see actor.megatron"),
    Key("ref.megatron.use_megatron_fsdp", VERL, "a separate reference is not built with LoRA (ref_in_actor)"),
    Key("ref.megatron.use_dist_checkpointing", VERL, "a separate reference is not built with LoRA (ref_in_actor)"),
    Key("ref.megatron.dist_checkpointing_path", VERL, "a separate reference is not built with LoRA (ref_in_actor)"),
    Key("ref.megatron.dist_checkpointing_prefix", VERL, "a separate reference is not built with LoRA"),
    Key("ref.megatron.dist_ckpt_optim_fully_reshardable", VERL, "a separate reference is not built with LoRA"),
    Key("ref.megatron.distrib_optim_fully_reshardable_mem_efficient", VERL, "a separate reference is not built"),
    Key("ref.megatron.router_replay.*", VERL, "the reference pass runs without replay (verl's rule)"),
    Key("ref.megatron.qat.*", VERL, "a separate reference is not built with LoRA (ref_in_actor)"),
    Key("ref.megatron.dtype", VERL, "the reference is the actor's model (its dtype)"),
    # -- rollout -------------------------------------------------------------------------------------------------
    Key("rollout.*", VERL, "verl's vLLM server and agent loop, unchanged (our replica subclasses them)"),
    Key("rollout.name", OURS, "must be moe_lora_vllm (our replica)"),
    _only("rollout.mode", "async", "verl 0.9.1's rollout is async"),
    Key("rollout.enforce_eager", OURS, "our replica always runs vLLM eager (route capture hooks the MoE layers); "
        "False is read as True"),
    _only("rollout.cudagraph_capture_sizes", None, "our replica runs vLLM eager: remove it"),
    Key("rollout.load_format", OURS, "dummy: the first weight sync carries the base; with the moe_lora checkpoint "
        "backend the engine reads the base from the checkpoint (auto)"),
    Key("rollout.layered_summon", VERL, "accepted: verl's Megatron engine ignores it too"),
    Key("rollout.enable_rollout_routing_replay", OURS, "R3: our replica captures the routes (needed with "
        "router_replay.mode=R3)"),
    Key("rollout.checkpoint_engine.backend", OURS, "naive (colocated), or our moe_lora / moe_lora_base backends"),
    Key("rollout.checkpoint_engine.custom_backend_module", OURS, "moe_lora_rl.integration.verl.plugin for ours"),
    _only("rollout.quantization", None, "the rollout serves the trained precision (fp32/bf16): remove it"),
    _only("rollout.quantization_config_file", None, "see rollout.quantization"),
    _only("rollout.multi_stage_wake_up", False, "our replica keeps the base resident (sleep level 1): remove it"),
    _only("rollout.disaggregation.enabled", False, "prefill/decode disaggregation is not served by our replica"),
    _only("rollout.over_sample_rate", 0, "verl's over-sampling aborts requests whose routes our capture drops: "
          "remove it"),
    _only("rollout.mtp.enable", False, "MTP is not served by our replica (model.mtp.enable)"),
    _only("rollout.mtp.enable_rollout", False, "speculative decoding with MTP is not served by our replica"),
    _only("rollout.mtp.enable_train", False, "MTP layers are not trained by our engine"),
    _only("rollout.qat.enable", False, "quantization-aware training is not supported (actor.megatron.qat.enable)"),
    Key("rollout.engine_kwargs.*", VERL, "passed to vLLM by verl (vLLM's own LoRA and route keys refused)"),
)

_BY_PATH = {k.path: k for k in TABLE}
assert len(_BY_PATH) == len(TABLE), "a path appears twice in the key table"


def lookup(path: str) -> Key | None:
    """The table row for PATH (relative to actor_rollout_ref): the exact row, else the longest "prefix.*" row, else a
    "prefix_*" row (a name prefix); None when no row covers it."""
    if path in _BY_PATH:
        return _BY_PATH[path]
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        row = _BY_PATH.get(".".join(parts[:n]) + ".*")
        if row is not None:
            return row
    head, _, leaf = path.rpartition(".")
    for k in TABLE:
        if k.path.endswith("_*") and k.path.rpartition(".")[0] == head and leaf.startswith(k.path.rpartition(".")[2][:-1]):
            return k
    return None


def _norm(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    return v


def refusal(path: str, value: Any, actor_value: Any = None) -> str | None:
    """The one-line refusal for actor_rollout_ref.PATH=VALUE, or None when it is honoured. ACTOR rows compare with
    the actor's value at the same path (ACTOR_VALUE)."""
    row = lookup(path)
    full = f"actor_rollout_ref.{path}"
    if row is None:
        return f"{full}={value!r} is not a key our override knows (verl 0.9.1's config has no such key, or it is " \
               "new): remove it"
    if row.how == ONLY:
        v = _norm(value)
        if v in ((), None) and None in row.allowed:
            return None
        if v not in tuple(_norm(a) for a in row.allowed):
            return f"{full}={value!r}: {row.why} (accepted: {', '.join(repr(a) for a in row.allowed)})"
    if row.how == ACTOR and _norm(value) != _norm(actor_value):
        return f"{full}={value!r} differs from actor_rollout_ref.actor.{path[len('ref.'):]}={actor_value!r}: " \
               f"{row.why}; set it to the actor's value or remove it"
    return None


def markdown() -> str:
    """The table as Markdown rows (docs/verl.md)."""
    lines = ["| key (under `actor_rollout_ref.`) | what we do | why |", "|---|---|---|"]
    for k in TABLE:
        how = {OURS: "ours", VERL: "verl's own code", ACTOR: "equal to the actor's",
               ONLY: "only " + ", ".join(f"`{a!r}`" for a in k.allowed)}[k.how]
        lines.append(f"| `{k.path}` | {how} | {k.why} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
