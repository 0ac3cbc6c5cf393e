#!/usr/bin/env bash
# verl's one-step-off-policy trainer (verl/experimental/one_step_off_policy) with our override on CPU: the trainer
# on one logical GPU, the rollout on its own (Ray's logical GPUs, no CUDA), each adapter version delivered by our
# checkpoint backend's mailbox (staged and checksummed in the worker extension). Every sync is recorded in
# OUT/sync.jsonl: the version the trainer sent, then the version the server serves and its log-probs of a fixed probe.
#   recipes/verl_moe_lora/run_cpu_one_step_off.sh [OUT_DIR] [extra verl overrides...]
# MODEL (default: the tiny model), STEPS (default 3). Checkpoints every step (the probe's reference, checks/verl_async).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-/tmp/verl_cpu_one_step_off}; shift || true
rm -f "$OUT/sync.jsonl"
PROBE='[1,87,85,259,201,85,307,86,296,295,295,281,300,2,201,1,333,85,75,265,344,86,201]'   # a held-out prompt
CONFIG_NAME=verl_moe_lora_one_step_off RAY_GPUS=2 RAY_CPUS=${RAY_CPUS:-12} bash "$HERE/run_cpu_smoke.sh" "$OUT" \
  rollout.nnodes=1 rollout.n_gpus_per_node=1 \
  actor_rollout_ref.rollout.checkpoint_engine.backend=moe_lora \
  +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.moe_lora.sync_log="$OUT/sync.jsonl" \
  "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.moe_lora.probe_tokens=$PROBE" \
  actor_rollout_ref.rollout.calculate_log_probs=true trainer.save_freq=1 reward.num_workers=2 \
  "$@"
