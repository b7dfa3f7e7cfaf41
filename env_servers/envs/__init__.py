"""Built-in Aviary environments (gsm8k, notebook, toy) and the source interface they share."""

import os

# Importing Aviary imports litellm, which otherwise fetches its model cost map over the network.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
