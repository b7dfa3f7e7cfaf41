#!/usr/bin/env bash
# Run the test suite: sets up .venv, a headless Chromium for the viewer and documentation site tests,
# bubblewrap for the notebook sandbox, gRPC C++ for the C++ client test, the vLLM wheels of the source
# check, then pytest in a loopback-only network namespace (below). Extra arguments go to pytest
# (e.g. scripts/test.sh -k env); scripts/test.sh --quick runs the tests not marked slow (tests/conftest.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup-venv.sh --full

# Debian packages some tests need, installed only when missing and only as root;
# the package index is refreshed at most once per run. Without them those tests skip.
can_apt_install() { [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; }
apt_updated=false
apt_install() {
  { $apt_updated || apt-get update -qq; } && apt_updated=true \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! command -v chromium >/dev/null 2>&1 && can_apt_install; then
  echo "installing chromium for the viewer and documentation site tests"
  apt_install chromium \
    || echo "chromium could not be installed; the browser tests (viewer, documentation site) will be skipped" >&2
fi

# The notebook environment runs agent code in a bubblewrap sandbox; without bwrap its tests skip
# (and `sciproto serve env --env notebook` refuses to start unless told `sandbox: none`).
if ! command -v bwrap >/dev/null 2>&1; then
  if can_apt_install; then
    echo "installing bubblewrap for the notebook sandbox"
    apt_install bubblewrap \
      || echo "bubblewrap could not be installed; the notebook sandbox tests will be skipped" >&2
  else
    echo "bubblewrap is missing and cannot be installed here (needs root and apt-get);" \
      "the notebook sandbox tests will be skipped" >&2
  fi
fi

# The Slurm recipe (scripts/slurm/train-on-ray.sbatch) is tested on a one-node Slurm cluster that
# the test starts on this machine (munged, slurmctld, slurmd on free ports).
if ! command -v slurmctld >/dev/null 2>&1 && can_apt_install; then
  echo "installing Slurm and munge for the Slurm recipe test"
  apt_install --no-install-recommends slurmctld slurmd slurm-client munge \
    || echo "Slurm could not be installed; the Slurm recipe test will be skipped" >&2
fi

# The C++ client (clients/cpp) builds its gRPC stubs from proto/ with these.
cpp_toolchain_ready() {
  command -v cmake && command -v c++ && command -v protoc && command -v grpc_cpp_plugin \
    && command -v pkg-config && pkg-config --exists grpc++ protobuf
} >/dev/null 2>&1
if ! cpp_toolchain_ready && can_apt_install; then
  echo "installing gRPC C++ and protoc for the C++ client test"
  apt_install --no-install-recommends libgrpc++-dev protobuf-compiler-grpc protobuf-compiler libprotobuf-dev cmake g++ pkg-config \
    || echo "gRPC C++ could not be installed; the C++ client test will be skipped" >&2
fi

# The vLLM wheels whose source tests/policy_server/test_vllm_source.py reads (not installed; cached
# in ~/.cache/sciproto/wheels, or SCIPROTO_WHEEL_CACHE): fetched here, since the tests reach no registry.
.venv/bin/python - <<'PY' || echo "the vLLM wheels could not be fetched; the vLLM source check will skip" >&2
import sys
sys.path.insert(0, "tests/policy_server")
from vllm_source import wheel_path
from policy_server.backends.vllm_api import RELEASES
for package, (version, _) in RELEASES.items():
    wheel_path(version, package=package)
PY

export LITELLM_LOCAL_MODEL_COST_MAP=True
args=()
for arg in "$@"; do
  # --quick: the tests that start no training run, real engine, browser or compiler (about a third of
  # the suite's time): what tests/conftest.py does not mark slow.
  if [[ $arg == --quick ]]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
# The suite runs on two pytest-xdist workers where the machine has two cores or more (about 0.6x the
# serial time on two): tests/conftest.py keeps each file's tests on one worker, in order, and the
# files that start a Ray cluster one at a time. SCIPROTO_TEST_WORKERS=N picks N workers; 0 runs
# serially.
workers_wanted=${SCIPROTO_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}
workers=()
if [[ $workers_wanted != 0 ]]; then workers=(-n "$workers_wanted" --dist loadgroup); fi
pytest=(.venv/bin/python -m pytest -q "${workers[@]}" "${args[@]}")
# pytest runs in a network namespace of its own whose only interface is loopback: nothing a test
# starts (servers, browsers, Ray, whose dashboard probes the cloud metadata address) reaches
# anything but this machine. Everything fetched from a registry is fetched above, before it.
if command -v unshare >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 \
    && unshare -n sh -c 'ip link set lo up' 2>/dev/null; then
  export SCIPROTO_TEST_NETWORK=loopback
  exec unshare -n sh -c 'ip link set lo up && exec "$@"' sh "${pytest[@]}"
fi
echo "unshare -n is not permitted here (needs root or CAP_SYS_ADMIN, and ip): the tests run with this machine's network" >&2
export SCIPROTO_TEST_NETWORK=host
exec "${pytest[@]}"
