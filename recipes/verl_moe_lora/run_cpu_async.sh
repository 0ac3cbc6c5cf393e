#!/usr/bin/env bash
# verl's asynchronous trainers with our override on CPU, with the learning run's settings (run_cpu_learn.sh:
# warm-started default model, sort task, lr 1e-3) and fp32 rollouts:
#   one_step_off   verl/experimental/one_step_off_policy      fully_async   verl/experimental/fully_async_policy
# The trainer on one logical GPU, the rollout on its own (Ray's logical GPUs, no CUDA), each adapter version
# delivered by our checkpoint backend's mailbox (staged and checksummed in the worker extension). Every sync is
# recorded in OUT/sync.jsonl: the version the trainer sent, then the version the server serves and its log-probs of
# a fixed probe (a held-out prompt); checkpoints every step are the probe's reference (checks/verl_async.py).
#   recipes/verl_moe_lora/run_cpu_async.sh one_step_off|fully_async [OUT_DIR] [extra verl overrides...]
# STEPS (default 4).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TRAINER=${1:-}; shift || true
# Ray's logical CPUs: verl's fully-async trainer and rollouter actors ask 10 each, its message queue 2
case "$TRAINER" in
  one_step_off) CPUS=12; EXTRA=() ;;
  fully_async) CPUS=32    # one prompt per rollout step, 8 prompts (the mini-batch) per training step, a sync after each
    EXTRA=(data.train_batch_size=0 rollout.n=8 rollout.total_rollout_steps=$(( ${STEPS:-4} * 8 ))
           async_training.trigger_parameter_sync_step=1 async_training.require_batches=1) ;;
  *) echo "run_cpu_async.sh: trainer '$TRAINER' is not one_step_off or fully_async" >&2; exit 2 ;;
esac
OUT=${1:-/tmp/verl_cpu_$TRAINER}; shift || true
rm -f "$OUT/sync.jsonl"
PROBE='[1,87,85,259,201,85,307,86,296,295,295,281,300,2,201,1,333,85,75,265,344,86,201]'
CONFIG_NAME=verl_moe_lora_$TRAINER RAY_GPUS=2 RAY_CPUS=${RAY_CPUS:-$CPUS} STEPS=${STEPS:-4} TEST_FREQ=-1 \
bash "$HERE/run_cpu_learn.sh" "$OUT" \
  trainer.val_before_train=false rollout.nnodes=1 rollout.n_gpus_per_node=1 \
  actor_rollout_ref.rollout.dtype=float32 \
  actor_rollout_ref.rollout.checkpoint_engine.backend=moe_lora \
  +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.moe_lora.sync_log="$OUT/sync.jsonl" \
  "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.moe_lora.probe_tokens=$PROBE" \
  actor_rollout_ref.rollout.calculate_log_probs=true trainer.save_freq=1 reward.num_workers=2 \
  "${EXTRA[@]}" "$@"
