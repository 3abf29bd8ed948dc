"""Helpers that the tests, the benchmarks and the examples share.

They live in the package, not in ``tests/``, so that ``benchmarks/`` and
``examples/`` import them like any other part of kvstore, from a checkout or an
installed package, never across folders by path. Nothing in the library
proper imports them: this is the top layer, beside the CLI.

- ``kvstore.testing.ports``: ``free_port``.
- ``kvstore.testing.redis``: ``RedisServer``, ``ServerCluster``: real
  redis-server / valkey-server processes on free ports (``available(flavor)``).
- ``kvstore.testing.server``: ``KVServer``: a real kvstore-server process;
  ``clean_env`` (the environment without ``KVSTORE_*``).
- ``kvstore.testing.mix``: ``Mix``: a verifying load of many clients (put, get,
  lookup, delete), the fault suite's and the soak's.
- ``kvstore.testing.tinymodel``: ``make_tiny_llama``: a random Llama and a
  tokenizer for vLLM, written offline.

The submodules are not imported here: each brings its own dependencies (grpc,
numpy, torch), and importing ``kvstore.testing`` stays free.
"""
