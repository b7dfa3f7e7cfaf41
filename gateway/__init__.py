"""An OpenAI-compatible HTTP gateway over PolicyService.Generate that records the exact tokens of
every call of a session and turns closed sessions into rollout groups for training."""
