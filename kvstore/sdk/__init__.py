"""The SDK: what a program talking to kvstore-server imports.

``client`` (the blocking ``Client``) and ``aio`` (``AsyncClient``) drive one client
core (``client_core``, ``client_writes``, ``client_lookup``: each operation written once) over their
transports; ``base`` holds their shared state, URLs and request building, ``shm`` the
leases and reservations seen through the server's shared-memory arena, ``wire`` the
mapping between protobuf messages and kvstore's types. The SDK stands on the core
(the modules at ``kvstore/``'s top) and never imports the engine (``kvstore.engine``):
a client on a laptop loads no store, tier or LMDB. See docs/architecture.md.

The public face is this package: ``from kvstore.sdk import Client, Lease, ...``. The
connectors use nothing else of the SDK (an import-linter contract in pyproject.toml);
the modules inside are free to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.sdk.chunks import chunk_header, unsealed_header
from kvstore.sdk.scatter import ScatterBatch
from kvstore.sdk.shm import (
    USE_GET,
    AsyncLease,
    AsyncReservation,
    Lease,
    LeaseBase,
    LentLease,
    Reservation,
    ReservationBase,
    UseGet,
    populate,
)

__all__ = [
    "USE_GET",
    "AsyncClient",
    "AsyncLease",
    "AsyncReservation",
    "Client",
    "Lease",
    "LeaseBase",
    "LentLease",
    "Reservation",
    "ReservationBase",
    "ScatterBatch",
    "UseGet",
    "chunk_header",
    "populate",
    "unsealed_header",
]

if TYPE_CHECKING:
    from kvstore.sdk.aio import AsyncClient
    from kvstore.sdk.client import Client


def __getattr__(name: str) -> Any:
    # The clients (their transports and the generated stubs) load on first use only.
    if name == "Client":
        from kvstore.sdk.client import Client

        return Client
    if name == "AsyncClient":
        from kvstore.sdk.aio import AsyncClient

        return AsyncClient
    raise AttributeError(f"module 'kvstore.sdk' has no attribute {name!r}")
