#!/usr/bin/env bash
# Qwen3-30B-A3B, expert LoRA r32 with R3, verl separate_async: 8 training GPUs (tp4 ep8, the planner's pick:
# python -m moe_lora_rl.plan --model qwen3-30b-a3b --gpus 16) + 8 rollout GPUs. GPU only; not run on CPU.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-30B-A3B}
NNODES=${NNODES:-2}; GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-4}; EP=${EP:-8}; PP=${PP:-1}; TRAIN_GPUS=${TRAIN_GPUS:-8}; ROLLOUT_TP=${ROLLOUT_TP:-4}
python "$HERE/check_layouts.py" qwen3-30b-a3b "tp${TP}ep${EP}pp${PP}" "$TRAIN_GPUS"
python "$HERE/main_verl_moe_lora.py" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$TP" \
  actor_rollout_ref.actor.megatron.expert_model_parallel_size="$EP" \
  actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="$PP" \
  actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP" \
  actor_rollout_ref.hybrid_engine=false trainer.v1.trainer_mode=separate_async \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  data.train_batch_size=256 actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 "$@"
