"""A task behind the AgentRL task-worker HTTP API (``server``), served as its ``options`` (``WorkerOptions``) say."""
