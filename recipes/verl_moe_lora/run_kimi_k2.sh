#!/usr/bin/env bash
# Kimi-K2 (DeepSeek-V3 architecture, 384 experts), expert LoRA with R3, verl separate_async on 128 GPUs:
# 64 training GPUs (tp8 ep64, the planner's pick: python -m moe_lora_rl.plan --model kimi-k2 --gpus 128) + 64
# rollout GPUs. GPU only. check_layouts.py checks the layout against Kimi-K2's config and maps every tensor name of
# the released checkpoint (per-expert names, fp8 weight_scale_inv) onto the layout's Megatron parameters, from the
# config alone; the MLA builder itself is tested on tiny DeepseekV3 models on CPU.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL_PATH=${MODEL_PATH:-moonshotai/Kimi-K2-Instruct}
NNODES=${NNODES:-16}; GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-8}; EP=${EP:-64}; PP=${PP:-1}; TRAIN_GPUS=${TRAIN_GPUS:-64}; ROLLOUT_TP=${ROLLOUT_TP:-2}
python "$HERE/check_layouts.py" kimi-k2 "tp${TP}ep${EP}pp${PP}" "$TRAIN_GPUS"
python "$HERE/main_verl_moe_lora.py" \
  actor_rollout_ref.model.path="$MODEL_PATH" actor_rollout_ref.model.trust_remote_code=true \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$TP" \
  actor_rollout_ref.actor.megatron.expert_model_parallel_size="$EP" \
  actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="$PP" \
  actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP" \
  actor_rollout_ref.hybrid_engine=false trainer.v1.trainer_mode=separate_async \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  data.train_batch_size=512 actor_rollout_ref.rollout.n=8 actor_rollout_ref.model.lora.rank=128 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1 "$@"
