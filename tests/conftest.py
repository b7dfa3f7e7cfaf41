"""Fixtures shared by every test folder."""

from __future__ import annotations

import os

# Aviary imports litellm, which otherwise fetches a price list over the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
