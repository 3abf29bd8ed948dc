"""The engine: the store a kvstore-server (or a program embedding one) runs.

``store.TieredStore`` is its public face (``store_reads``, ``store_writedown`` are its
parts); ``index`` and ``lookup`` find stored prefixes, ``writer`` and ``fallback`` move
chunks between tiers, ``tiers`` holds the tier contract (``tiers/base.py``) and its
implementations (memory, disk, remote). The engine stands on the core (the modules at
``kvstore/``'s top) and never imports the SDK, gRPC or the server. See
docs/architecture.md.
"""
