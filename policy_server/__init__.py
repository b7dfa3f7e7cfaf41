"""policy_server package."""
