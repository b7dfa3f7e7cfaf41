#!/usr/bin/env bash
# Run the test suite: sets up .venv, a headless Chromium for the viewer test,
# then pytest. Extra arguments go to pytest (e.g. scripts/test.sh -k env).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup-venv.sh

if ! command -v chromium >/dev/null 2>&1 && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium for the viewer test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "chromium could not be installed; the viewer's browser test will be skipped" >&2
fi

export LITELLM_LOCAL_MODEL_COST_MAP=True
exec .venv/bin/python -m pytest -q "$@"
