"""The SDK: what a program talking to kvstore-server imports.

``client`` (the blocking ``Client``) and ``aio`` (``AsyncClient``) drive one client
core (``client_core``, ``client_writes``: each operation written once) over their
transports; ``base`` holds their shared state, URLs and request building, ``shm`` the
leases and reservations seen through the server's shared-memory arena, ``wire`` the
mapping between protobuf messages and kvstore's types. The SDK stands on the core
(the modules at ``kvstore/``'s top) and never imports the engine (``kvstore.engine``):
a client on a laptop loads no store, tier or LMDB. See docs/architecture.md.
"""
