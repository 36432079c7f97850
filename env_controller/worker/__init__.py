"""A task behind the AgentRL task-worker HTTP API (``server``)."""
