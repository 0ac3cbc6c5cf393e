#!/usr/bin/env bash
# verl's main_ppo (V0 trainer) with our engine, replica and CPU platform on the tiny GLM-4.5-style model (or MODEL):
# a 2-step GRPO run on CPU (fp32, tp1 ep1, 1 Ray worker, batch 2 x n 2, responses of 16 tokens).
# Colocated sync with vLLM started on dummy weights (verl's default; the recipe config loads the base from disk):
# the rollout's weights are then exactly what the first sync put there.
#   recipes/verl_moe_lora/run_cpu_smoke.sh [OUT_DIR] [extra verl overrides...]
# Data: the built-in sort task (python -m moe_lora_rl.data sort), or your verl-format files with verl's own keys
# data.train_files=FILE data.val_files=FILE (a file or [a,b]). Reward: verl's reward.custom_reward_function.path= /
# .name= (default pkg://moe_lora_rl.data.rewards compute_score: the main job's default reward, a built-in task's
# scorer, else integration/verl/reward_score: verl's scorers, with gsm8k and the math sources read whole). Lengths: data.max_prompt_length is the data's longest prompt
# (tokens, chat template; at least 32) unless PROMPT_LEN is set; data.max_response_length is RESPONSE_LEN (default
# 16 on the sort task, 64 on your files); rollout.max_model_len their sum. Overrides given here win over all three.
# R3 on (R3=off turns it off): verl's routed_experts come from our replica's capture (vLLM's own return stays off);
# each log-prob recompute is also run without replay and both k3 KLs against the rollout go to OUT/r3_check.jsonl.
# Prints the log's last lines and "SMOKE: finished N steps" or "SMOKE: stopped (rc)".
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:-/tmp/verl_cpu_smoke}; shift || true
PY=${PYTHON:-$ROOT/.venv/bin/python}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export VERL_PLATFORM=moe_lora_cpu VERL_ENGINE_DEVICE=cpu                   # our CPU platform (never auto-detected)
export VERL_USE_EXTERNAL_MODULES=moe_lora_rl.integration.verl.plugin # so every Ray worker registers it
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
# MODEL: a checkpoint dir (run_cpu_learn.sh passes the warm-started default model; e.g. a deepseek_v3 model:
# MODEL=$(python -c 'from moe_lora_rl.models import get_model; print(get_model("deepseek_v3", "tiny_rope"))'));
# default the tiny GLM-4.5-style model
MODEL=${MODEL:-$("$PY" -c 'from moe_lora_rl.models import get_model; print(get_model("glm4_moe", "tiny"))')}
# verl's agent loop picks its token builder from the model_type (GLM-4.7's for glm4_moe, DeepSeek's for deepseek_v3),
# which needs that family's turn tokens; the tiny models' offline tokenizer lacks them: a copy of the model whose
# tokenizer has them as added special tokens (builder_tokens.py)
[ -f "$OUT/model/config.json" ] || "$PY" "$HERE/builder_tokens.py" "$MODEL" "$OUT/model" || exit 2
MODEL=$OUT/model
TRAIN= VAL=
for a in "$@"; do
  case "$a" in data.train_files=*) TRAIN=${a#*=} ;; data.val_files=*) VAL=${a#*=} ;; esac
done
if [ -z "$TRAIN" ]; then
  [ -f "$OUT/data/val.parquet" ] || "$PY" -m moe_lora_rl.data sort "$OUT/data" >/dev/null
  TRAIN=$OUT/data/train.parquet VAL=${VAL:-$OUT/data/val.parquet} RESPONSE_LEN=${RESPONSE_LEN:-16}
fi
VAL=${VAL:-$TRAIN}
# the longest prompt in tokens through the model's chat template (as verl's RLHFDataset applies it); 10k rows a file
PROMPT_LEN=${PROMPT_LEN:-$("$PY" -c 'import sys
from transformers import AutoTokenizer
from moe_lora_rl.data.dataset import load_examples
from moe_lora_rl.data.hf_sampling import prompt_ids
tok = AutoTokenizer.from_pretrained(sys.argv[1])
files = [f for a in sys.argv[2:] for f in a.strip("[]").split(",") if f]
n = max(max(map(len, prompt_ids(tok, load_examples(f)[:10000], "chat"))) for f in files)
print(max(32, -(-n // 8) * 8))' "$MODEL" "$TRAIN" "$VAL")} || { echo "SMOKE: cannot read $TRAIN / $VAL"; exit 2; }
RESPONSE_LEN=${RESPONSE_LEN:-64}
STEPS=${STEPS:-2}
if [ "${R3:-on}" = on ]; then
  ROUTES=(actor_rollout_ref.actor.megatron.router_replay.mode=R3 actor_rollout_ref.rollout.enable_rollout_routing_replay=true
          +actor_rollout_ref.actor.megatron.r3_check_log="$OUT/r3_check.jsonl")
else
  ROUTES=(actor_rollout_ref.actor.megatron.router_replay.mode=disabled actor_rollout_ref.rollout.enable_rollout_routing_replay=false)
fi
# a Ray cluster already up (RAY_ADDRESS: ray_on_slurm.sbatch) has its resources; ray.init refuses them on a join. Its
# workers were started without this script's environment (a local Ray's inherit it): on a join the variables that
# select our platform and plugin go to every actor through the job's runtime_env (verl merges ray_init.runtime_env)
RAY_INIT=(+ray_kwargs.ray_init.num_gpus="${RAY_GPUS:-1}" +ray_kwargs.ray_init.num_cpus="${RAY_CPUS:-4}")
if [ -n "${RAY_ADDRESS:-}" ]; then
  RAY_INIT=()
  for v in VERL_PLATFORM VERL_ENGINE_DEVICE VERL_USE_EXTERNAL_MODULES VLLM_CPU_KVCACHE_SPACE VLLM_CPU_OMP_THREADS_BIND \
           TOKENIZERS_PARALLELISM PYTHONPATH HF_HUB_OFFLINE; do
    [ -z "${!v:-}" ] || RAY_INIT+=("+ray_kwargs.ray_init.runtime_env.env_vars.$v='${!v}'")
  done
fi
rm -f "$OUT/r3_check.jsonl"
start=$(date +%s)
# the run in a session of its own: past TIMEOUT every process of that session (the driver, its local Ray instance,
# Ray's workers and their engines) is ended, and nothing else (another Ray instance of this user keeps running)
"$PY" -m moe_lora_rl.procs --timeout-s "${TIMEOUT:-1500}" -- "$PY" "$HERE/main_verl_moe_lora.py" --config-name "${CONFIG_NAME:-verl_moe_lora}" \
  trainer.use_v1=false \
  "${RAY_INIT[@]}" \
  trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.logger='[console]' \
  trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.total_training_steps="$STEPS" trainer.total_epochs=1 trainer.default_local_dir="$OUT/ckpt" \
  trainer.project_name=cpu_smoke trainer.experiment_name=tiny \
  data.train_files="$TRAIN" data.val_files="$VAL" \
  data.train_max_samples=16 data.val_max_samples=4 data.train_batch_size=2 \
  data.max_prompt_length="$PROMPT_LEN" data.max_response_length="$RESPONSE_LEN" data.dataloader_num_workers=0 \
  reward.custom_reward_function.path=pkg://moe_lora_rl.data.rewards reward.custom_reward_function.name=compute_score \
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=false \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.lora.rank=4 actor_rollout_ref.model.lora.alpha=8 \
  actor_rollout_ref.actor.megatron.dtype=float32 +actor_rollout_ref.actor.megatron.device=cpu \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
  actor_rollout_ref.actor.megatron.expert_model_parallel_size=1 \
  actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
  actor_rollout_ref.actor.use_kl_loss=false \
  "${ROUTES[@]}" \
  actor_rollout_ref.actor.ppo_mini_batch_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.rollout.n=2 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.dtype=float32 actor_rollout_ref.rollout.max_model_len=$((PROMPT_LEN + RESPONSE_LEN)) \
  actor_rollout_ref.rollout.free_cache_engine=false +actor_rollout_ref.rollout.enable_sleep_mode=false \
  actor_rollout_ref.rollout.checkpoint_engine.backend=naive actor_rollout_ref.rollout.agent.num_workers=1 \
  actor_rollout_ref.rollout.load_format=dummy \
  "$@" > "$OUT/run.log" 2>&1
rc=$?
echo "SMOKE: wall $(( $(date +%s) - start )) s, log $OUT/run.log"
grep -E "Error|error:|Traceback" "$OUT/run.log" | grep -v "^.*Warning" | tail -n 8
tail -n 15 "$OUT/run.log"
n=$(grep -Ec "step:[0-9]+ " "$OUT/run.log")
if [ "$rc" = 0 ]; then echo "SMOKE: finished, $n step lines logged"; else echo "SMOKE: stopped (rc=$rc), $n step lines logged"; fi
exit $rc
