"""The HTTP plumbing every server and client of the env protocol shares: ``service`` (JSON in and out
under limits, error replies, request bodies under a size and a time limit, the server lifecycle),
``options`` (``HttpOptions``: the request and connection limits every server includes in its options),
``auth`` (credentials by role, redacted URLs, the bind rule), ``net`` (free ports, the local
address that reaches a peer) and ``client`` (``PooledHttp``, a pooled HTTP/1.1 client). Other packages import these
as the public API they are."""
