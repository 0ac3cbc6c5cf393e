#!/usr/bin/env bash
# verl's examples/grpo_trainer/run_qwen3moe-30b_megatron_lora.sh (verl 0.9.1's Megatron + LoRA GRPO example), kept
# key for key with our override and scaled to this CPU machine. What differs from verl's script, and why:
#   sizes      the tiny qwen3_moe (MODEL), 2 steps, batch 2 x n 4, prompt/response 32/16 tokens (the smoke's data),
#              mini-batch 2, lr 3e-6 kept; TP/PP/EP/ETP from the environment (TP=2 EP=2 ETP=1 PP=1 on 2 workers)
#   CPU keys   run_cpu_smoke.sh's: our CPU platform, fp32, gloo, no sleep mode (free_cache_engine=false), Ray's fake
#              GPUs (RAY_GPUS), rollout TP 1, the recipe's entry (it checks every key before Ray starts, and selects
#              the gloo-first worker on CPU) in place of `python3 -m verl.trainer.main_ppo --config-path=config`
#   ours       docs/verl.md's additions, all in config/moe_lora.yaml (the recipe's config): the plugin, our engine
#              config, rollout.name=moe_lora_vllm, trainer.use_v1=false, the NaN-refusing reward manager; R3 on
#   refused    CP=2 (context parallelism is refused up front by our key table: CP=1 here);
#              actor.megatron.grad_offload is not a key of verl 0.9.1's config (hydra refuses it): left out
#   data       the smoke's sort task (your files: data.train_files=... data.val_files=..., see run_cpu_smoke.sh)
#   trainer    TRAINER=main_ppo (default) or one_step_off: verl's one-step-off-policy trainer, the rollout on its own
#              pool of ROLLOUT_WORKERS (default 1) fed by our checkpoint backend (config/verl_moe_lora_one_step_off.yaml)
#   recipes/verl_moe_lora/run_qwen3moe_megatron_lora_cpu.sh [OUT_DIR] [extra verl overrides...]
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:-/tmp/verl_qwen3moe_lora_cpu}; shift || true
PY=${PYTHON:-$ROOT/.venv/bin/python}
TP=${TP:-2}
PP=${PP:-1}
CP=1
EP=${EP:-2}
ETP=${ETP:-1}
WORKERS=${WORKERS:-$(( TP * PP * (EP * ETP > TP ? EP * ETP / TP : 1) ))}
TRAINER=${TRAINER:-main_ppo}
case "$TRAINER" in
  main_ppo) POOL=0; SEPARATE=() ;;
  one_step_off) POOL=${ROLLOUT_WORKERS:-1}; export CONFIG_NAME=verl_moe_lora_one_step_off
    # the smoke's colocated sync (backend=naive) is replaced by our checkpoint backend, as in run_cpu_async.sh
    SEPARATE=(rollout.nnodes=1 rollout.n_gpus_per_node="$POOL" actor_rollout_ref.rollout.checkpoint_engine.backend=moe_lora) ;;
  *) echo "run_qwen3moe_megatron_lora_cpu.sh: TRAINER=$TRAINER is not main_ppo or one_step_off" >&2; exit 2 ;;
esac
MODEL=${MODEL:-$("$PY" -c 'from moe_lora_rl.models import get_model; print(get_model("qwen3_moe", "tiny"))')}

ALL_OFFLOAD=${ALL_OFFLOAD:-False}
COMMON_PARAM_OFFLOAD=${COMMON_PARAM_OFFLOAD:-$ALL_OFFLOAD}
COMMON_OPTIMIZER_OFFLOAD=${COMMON_OPTIMIZER_OFFLOAD:-$ALL_OFFLOAD}
ACTOR_PARAM_OFFLOAD=${ACTOR_PARAM_OFFLOAD:-$COMMON_PARAM_OFFLOAD}
ACTOR_OPTIMIZER_OFFLOAD=${ACTOR_OPTIMIZER_OFFLOAD:-$COMMON_OPTIMIZER_OFFLOAD}
REF_PARAM_OFFLOAD=${REF_PARAM_OFFLOAD:-$COMMON_PARAM_OFFLOAD}

MODEL=$MODEL RESPONSE_LEN=${RESPONSE_LEN:-16} PROMPT_LEN=${PROMPT_LEN:-32} RAY_GPUS=$((WORKERS + POOL)) RAY_CPUS=${RAY_CPUS:-$((4 * (WORKERS + POOL) + 4 * (POOL > 0)))} \
  bash "$HERE/run_cpu_smoke.sh" "$OUT" \
    algorithm.adv_estimator=grpo \
    trainer.val_before_train=False \
    data.train_batch_size=2 \
    data.truncation='error' \
    data.filter_overlong_prompts=True \
    data.shuffle=False \
    actor_rollout_ref.model.lora.rank=16 \
    actor_rollout_ref.model.lora.alpha=32 \
    actor_rollout_ref.model.use_fused_kernels=True \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=2 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.actor.megatron.use_mbridge=True \
    actor_rollout_ref.actor.megatron.vanilla_mbridge=False \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$TP \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$PP \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.25 \
    actor_rollout_ref.rollout.enforce_eager=True \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=$TP \
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=$PP \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=$EP \
    actor_rollout_ref.ref.megatron.expert_model_parallel_size=$EP \
    actor_rollout_ref.actor.megatron.context_parallel_size=$CP \
    actor_rollout_ref.ref.megatron.context_parallel_size=$CP \
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=$ETP \
    actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=$ETP \
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform \
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full \
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1 \
    actor_rollout_ref.actor.megatron.param_offload=${ACTOR_PARAM_OFFLOAD} \
    actor_rollout_ref.actor.megatron.optimizer_offload=${ACTOR_OPTIMIZER_OFFLOAD} \
    actor_rollout_ref.ref.megatron.param_offload=${REF_PARAM_OFFLOAD} \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name='verl_grpo_example_gsm8k_math' \
    trainer.experiment_name='qwen3_moe_tiny_megatron_lora_cpu' \
    trainer.n_gpus_per_node=$WORKERS \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=-1 \
    trainer.total_epochs=15 "${SEPARATE[@]}" "$@"
