"""The trainer's env clients: ``http_client`` (an env controller over HTTP, its settings in ``options``) and
``local`` (built-in tasks in process); both speak the same ``EnvClient`` calls."""
