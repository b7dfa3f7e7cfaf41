#!/usr/bin/env bash
# Contract checks: buf lint (STANDARD), buf breaking (FILE) against the
# committed baseline image, and generated Python code up to date.
# Usage: scripts/check-contracts.sh [REPO_ROOT]   (default: this checkout)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${1:-$here}"
buf="$here/node_modules/.bin/buf"
[[ -x $buf ]] || (cd "$here" && npm ci --no-audit --no-fund --silent)
python="${PYTHON:-$here/.venv/bin/python}"

cd "$root/proto"
echo "buf lint";     "$buf" lint
echo "buf breaking"; "$buf" breaking --against baseline.binpb
cd "$root"
echo "generated code"; "$python" scripts/gen_proto.py --check
