"""The env controller between the trainer and the task workers: ``server`` (the asyncio HTTP
controller), ``options`` (its settings, ``ControllerConfig``), ``registry`` (workers by heartbeat),
``sessions`` (open sessions and their workers), ``metrics`` (Prometheus counters) and ``worker_http``
(its own HTTP client to the workers)."""
