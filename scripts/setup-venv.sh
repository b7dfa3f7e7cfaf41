#!/usr/bin/env bash
# Create or reuse .venv with sciproto and everything its tests need.
# Reinstalls only when pyproject.toml or package.json changed since last time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python="${PYTHON:-python3}"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "sciproto needs Python >= 3.11 (found $("$python" --version)); set PYTHON=..." >&2; exit 1; }
[[ -x .venv/bin/python ]] || "$python" -m venv .venv

stamp=.venv/.sciproto-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # Without a GPU, take the CPU build of torch (a looser spec pulls the CUDA build).
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q torch==2.13.0
  fi
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi

# Node.js tooling: buf for the contract checks and the Node.js client.
if command -v npm >/dev/null 2>&1 && [[ ! -d node_modules || package-lock.json -nt node_modules ]]; then
  npm ci --no-audit --no-fund --silent
fi
