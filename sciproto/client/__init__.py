"""The client library every component uses: env, policy and replica clients, retries, and the
rollout record schema. It imports only the core (`sciproto`), never a server or an application."""
