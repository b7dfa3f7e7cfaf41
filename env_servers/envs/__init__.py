"""Built-in Aviary environments (gsm8k, notebook, toy) and the source interface they share."""

import os

from env_servers.envs.deferred_litellm import defer_litellm

# Importing Aviary imports litellm, which otherwise fetches its model cost map over the network
# when it loads; and it loads only when first used (deferred_litellm).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
defer_litellm()
