#!/usr/bin/env bash
# The embedded default: a full local training run on the CPU (env server with
# the toy environment, policy server with the tiny model, learner, rollout
# client). Extra arguments go to `sciproto train` (e.g. --set learner.grpo.lr=1e-3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup-venv.sh
export LITELLM_LOCAL_MODEL_COST_MAP=True
exec .venv/bin/sciproto train --config demo "$@"
