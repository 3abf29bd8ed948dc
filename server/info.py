"""What a server tells clients about itself (the Info RPC), as clients and tenants see it.

Built once at start from the store and the server's settings; only the express plane's
socket is added later (``KVStoreService.offer_express``).
"""

from __future__ import annotations

import os
from typing import Any

from kvstore import __version__, accel
from kvstore.engine.store import TieredStore
from kvstore.keys import KEY_SCHEME
from kvstore.protocol import boot_id
from kvstore.records import FORMAT_VERSION
from kvstore.v1 import kvstore_pb2 as pb

from .config import ServerConfig

# What a tenant is not shown: the shared-memory plane (a process that maps the arena or
# L2's file could read every tenant's records; so could one reading the presence filter's
# bits, of which namespaces hold what), and lookups by keys: keys a client sends could
# name another tenant's chunks (in L3 above all, which the server cannot check by
# namespace), so tenants look up by token ids.
_NOT_FOR_TENANTS = (
    "shm_path", "shm_size", "boot_id", "shm_inode", "lookup_by_keys",
    "disk_path", "disk_inode", "disk_map_size",
    "presence_offset", "presence_bytes", "presence_nonce",
)  # fmt: skip


def make_info(
    store: TieredStore, config: ServerConfig, auth_required: bool
) -> tuple[pb.InfoResponse, pb.InfoResponse]:
    """The Info a client gets, and the one a tenant gets."""
    arena, cfg = store.arena, store.config
    shm = config.shm
    info = pb.InfoResponse(
        server_version=__version__,
        record_format=FORMAT_VERSION,
        key_scheme=KEY_SCHEME,
        chunk_tokens=cfg.chunk_tokens,
        granularity=cfg.granularity,
        max_chunk_bytes=cfg.max_chunk_bytes,
        piece_bytes=config.piece_bytes,
        max_message_bytes=config.max_message_bytes,
        shm_path=arena.path if shm else "",
        shm_size=store.arena_pages_bytes if shm else 0,  # the filter follows them
        boot_id=boot_id() if shm else "",
        shm_inode=os.stat(arena.path).st_ino if shm else 0,
        lease_ms=cfg.memory.lease_ms,
        tiers=store.tier_names,
        auth_required=auth_required,
        native=accel.IMPL,
        lookup_by_keys=True,
        **_disk_plane(store) if shm else {},
        **_presence(store) if shm else {},
    )
    tenant = pb.InfoResponse()
    tenant.CopyFrom(info)
    for name in _NOT_FOR_TENANTS:
        tenant.ClearField(name)
    return info, tenant


def _presence(store: TieredStore) -> dict[str, Any]:
    """The presence filter, for same-host clients to answer misses themselves."""
    where = store.presence()
    if where is None:
        return {}
    offset, size, nonce = where
    return {"presence_offset": offset, "presence_bytes": size, "presence_nonce": nonce}


def _disk_plane(store: TieredStore) -> dict[str, Any]:
    """L2's data file, for same-host clients to read loans from (AcquireMany's
    client_reads_disk): offered with the arena, when L2 is LMDB."""
    where = store.lending_file()
    if where is None:
        return {}
    path, map_size = where
    return {"disk_path": path, "disk_inode": os.stat(path).st_ino, "disk_map_size": map_size}
