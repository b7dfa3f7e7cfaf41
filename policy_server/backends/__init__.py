"""Policy backends: where tokens are sampled (the `PolicyBackend` protocol is in `base`).

Importing the package imports no backend and not torch, so the configuration's typed options
(`options`) and the plug-ins (`registry`) load without them."""
