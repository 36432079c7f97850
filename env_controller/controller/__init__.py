"""The env controller between the trainer and the task workers: ``server`` (the asyncio HTTP
controller), ``options`` (its settings, ``ControllerConfig``), ``registry`` (workers by heartbeat),
``sessions`` (open sessions and their workers) and ``metrics`` (Prometheus counters); its HTTP client to the
workers is :mod:`env_controller.http.client`."""
