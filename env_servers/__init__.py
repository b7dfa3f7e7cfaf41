"""env_servers package."""
