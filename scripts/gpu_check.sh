#!/usr/bin/env bash
# The GPU check (tests/kit/gpu_check.py; docs/setup.md, "GPU check"): megatron-core on CUDA in bf16 with
# per-expert LoRA and R3 replay, and a CUDA IPC bucket handoff between two processes, each against the CPU result.
# One JSON line on stdout; at most 8 minutes; needs no network.
#
#   bash scripts/gpu_check.sh [ARGS]                      with the Python that has torch (CUDA) and the deps
#   PIP_FIND_LINKS=wheels/ bash scripts/gpu_check.sh      first installs every wheels/*.whl (--no-index --no-deps)
#                                                         into a throwaway folder put first on PYTHONPATH
#   PYTHON=/path/to/python bash scripts/gpu_check.sh      another interpreter (default python3)
#   ARGS: --parts replay,ipc,base_ipc  --bucket-mib 2  --timeout 300  (python -m ... --help)
#
# Carrying the wheels (64 MiB in all): the machine brings torch with CUDA; carry what it lacks of the check's imports,
# e.g. built on a machine with network access:
#   pip download --no-deps -d wheels/ megatron-core==0.16.1 transformers tokenizers safetensors huggingface-hub
# and copy wheels/ next to the checkout (the device runner's `carry`, scp, ...). Nothing is fetched here.
#
# Exit status: 0 pass, 1 a part failed, 2 no GPU here (one line, nothing run), 3 the wheels did not install (one
# line), 124 over the 8-minute limit (one JSON line).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
LIMIT_S=480
export PYTHONPATH="$ROOT/tests:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore   # tests/: the kit

if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check: no GPU check: no Python interpreter $PY"; exit 2
fi
"$PY" -m kit.gpu_check --probe || exit $?      # no GPU: its one line, before any install

if [[ -n "${PIP_FIND_LINKS:-}" ]]; then
  TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
  shopt -s nullglob; WHEELS=("$PIP_FIND_LINKS"/*.whl); shopt -u nullglob
  if (( ${#WHEELS[@]} == 0 )); then echo "gpu_check: setup failed: no *.whl in PIP_FIND_LINKS=$PIP_FIND_LINKS"; exit 3; fi
  # into a folder of its own put first on PYTHONPATH (not a venv: a venv made from an interpreter that is itself a
  # venv, such as an image's torch venv, would not see that venv's torch)
  if ! "$PY" -m pip install -q --no-index --no-deps --target "$TMP/site" "${WHEELS[@]}" >"$TMP/setup.log" 2>&1; then
    echo "gpu_check: setup failed: installing ${#WHEELS[@]} wheels from $PIP_FIND_LINKS: $(grep -v '^\s*$' "$TMP/setup.log" | tail -1)"
    exit 3
  fi
  export PYTHONPATH="$TMP/site:$PYTHONPATH"
fi

timeout --kill-after=10 "$LIMIT_S" "$PY" -m kit.gpu_check "$@"
rc=$?
if (( rc == 124 || rc == 137 )); then
  echo "{\"check\": \"gpu\", \"pass\": false, \"error\": \"over the ${LIMIT_S} s limit\"}"; exit 124
fi
exit "$rc"
