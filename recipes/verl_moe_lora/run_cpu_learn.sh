#!/usr/bin/env bash
# A verl run that learns: verl's main_ppo (V0 trainer) through our recipe on the warm-started default model
# (glm4_moe wide) and the default sort task, with our main job's algorithm settings: GRPO, 8 prompts x 8 samples,
# PPO-clip 0.2 / 0.28, token-mean, lr 1e-3 (AdamW betas 0.9 / 0.99, no weight decay), LoRA rank 8 / alpha 16 on
# experts and attention, fp32 trainer, bf16 rollouts, R3 from our capture. verl's validation on our held-out parquet
# (256 problems, greedy: verl's default val_kwargs, so an unchanged policy scores the same) before training and
# every TEST_FREQ steps. (verl's rollout.full_determinism sets VLLM_BATCH_INVARIANT, which vLLM's CPU MoE kernel
# does not support: the engine would not start.)
#   recipes/verl_moe_lora/run_cpu_learn.sh [OUT_DIR] [extra verl overrides, e.g. actor_rollout_ref.actor.optim.lr=0]
# STEPS (default 80), TEST_FREQ (default 10), MODEL (default: the warm-started default model). Prints
# "LEARN: val <step> <success>" per validation.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:-/tmp/verl_cpu_learn}; shift || true
PY=${PYTHON:-$ROOT/.venv/bin/python}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
MODEL=${MODEL:-$("$PY" -c 'from moe_lora_rl.rl.config import TrainConfig; from moe_lora_rl.rl.inputs import model_dir
print(model_dir(TrainConfig())[0])')} || exit 1
export MODEL STEPS=${STEPS:-80} TIMEOUT=${TIMEOUT:-5400}
TEST_FREQ=${TEST_FREQ:-10}
bash "$HERE/run_cpu_smoke.sh" "$OUT" \
  trainer.val_before_train=true trainer.test_freq="$TEST_FREQ" trainer.experiment_name=learn \
  data.train_max_samples=-1 data.val_max_samples=-1 data.train_batch_size=8 data.max_response_length=8 \
  actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.dtype=bfloat16 \
  actor_rollout_ref.rollout.max_model_len=64 \
  actor_rollout_ref.model.lora.rank=8 actor_rollout_ref.model.lora.alpha=16 \
  'actor_rollout_ref.model.lora.targets=[experts,attention]' \
  actor_rollout_ref.actor.optim.lr=1e-3 actor_rollout_ref.actor.optim.weight_decay=0.0 \
  'actor_rollout_ref.actor.optim.betas=[0.9,0.99]' actor_rollout_ref.actor.optim.clip_grad=1.0 \
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
  "$@"
rc=$?
grep -oE "step:[0-9]+ .*val-core/[^ ]*/acc/mean@1:(np.float64\()?[0-9.e-]+" "$OUT/run.log" \
  | sed -E 's/^step:([0-9]+) .*val-core\/[^ ]*\/acc\/mean@1:(np.float64\()?([0-9.e-]+)$/LEARN: val \1 \3/'
exit $rc
