"""Fixtures shared by every test folder."""

from __future__ import annotations

import os

# Aviary imports litellm, which otherwise fetches a price list over the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Test processes share two cores with the servers they start: spinning OpenMP
# workers would starve them (see clients/cli.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _bwrap_problem() -> str | None:
    from env_servers.sandbox import SandboxUnavailable, bwrap_path

    try:
        bwrap_path()
    except SandboxUnavailable as error:
        return str(error)
    return None


# Why the notebook sandbox cannot run on this host (None: it can). Where it cannot, the tests of
# the sandbox skip and the other notebook tests run it with `sandbox: none`.
BWRAP_PROBLEM = _bwrap_problem()
NOTEBOOK_SANDBOX = "bwrap" if BWRAP_PROBLEM is None else "none"
