"""Fixtures shared by every test folder."""

from __future__ import annotations

import os

# Aviary imports litellm, which otherwise fetches a price list over the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Test processes share two cores with the servers they start: spinning OpenMP
# workers would starve them (see sciproto/cli.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
