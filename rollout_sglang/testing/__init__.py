"""Test support: the SGLang stand-in server and what only it speaks.

:mod:`.sglang_standin` (an SGLang-shaped HTTP server over the local engine, for tests and CPU
runs; its settings in :mod:`.standin_options`), :mod:`.transport` (its weight-update extensions:
point-to-point sends, bucket checksums, as a transport for the trainer's sender) and :mod:`.checksum`.
The packages never import this one; tests, benchmarks and CPU setups import its modules by name.
"""
