"""Engines that take token ids and return token ids with their log-probs, and the pool that holds them.

``protocol``: the engine protocol and its records; ``local``: a transformers model in process;
``sglang_client``: the client of one SGLang server (``sglang_options``: its settings and its launch's);
``batching``: concurrent calls merged into one batch;
``version_pool``: slots of engines holding the latest weight versions, and the cross-policy router.
"""
