"""The SDK's half of the wire: what a client reads back that a server never sends itself.

Failed calls become kvstore errors (by the code and reason each error class names:
``kvstore.errors``), and the Info and Namespaces replies become ``ServerInfo`` and
``NamespaceInfo``. Everything both ends share lives in the core, ``kvstore.protocol``.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvstore import errors
from kvstore.keys import Fingerprint, Namespace
from kvstore.protocol import ERROR_REASON_HEADER
from kvstore.v1 import kvstore_pb2 as pb


@dataclass(frozen=True)
class ServerInfo:
    """What a server is and offers (the Info RPC)."""

    server_version: str
    record_format: int
    key_scheme: str
    chunk_tokens: int
    granularity: int
    max_chunk_bytes: int
    piece_bytes: int
    max_message_bytes: int
    shm_path: str
    shm_size: int
    boot_id: str
    shm_inode: int
    lease_ms: int
    tiers: tuple[str, ...]
    auth_required: bool
    native: str = ""  # the server's kvstore.accel.IMPL ("" from servers before it was sent)
    lookup_by_keys: bool = False  # Lookup takes chunk keys and sub-hashes (False: token ids only)
    express_socket: str = ""  # the express plane's Unix socket (kvstore.express); "": none
    disk_path: str = ""  # L2's data file, which loans are in ("": L2 lends nothing)
    disk_inode: int = 0  # its inode: the client maps it only where it is this file
    disk_map_size: int = 0  # LMDB's map: the most the file can grow to
    presence_offset: int = 0  # the presence filter in the arena file (kvstore.presence)
    presence_bytes: int = 0  # its header and bits; 0: the server offers none
    presence_nonce: int = 0  # what its header says while this server writes it


@dataclass(frozen=True)
class NamespaceInfo:
    """One namespace the server holds chunks of (the Namespaces RPC)."""

    fingerprint: Fingerprint
    chunks: int
    bytes: int  # raw payload bytes
    namespace: Namespace | None  # when a client described it (a lookup with a Namespace)


def info_from_pb(m: pb.InfoResponse) -> ServerInfo:
    return ServerInfo(
        server_version=m.server_version,
        record_format=m.record_format,
        key_scheme=m.key_scheme,
        chunk_tokens=m.chunk_tokens,
        granularity=m.granularity,
        max_chunk_bytes=m.max_chunk_bytes,
        piece_bytes=m.piece_bytes,
        max_message_bytes=m.max_message_bytes,
        shm_path=m.shm_path,
        shm_size=m.shm_size,
        boot_id=m.boot_id,
        shm_inode=m.shm_inode,
        lease_ms=m.lease_ms,
        tiers=tuple(m.tiers),
        auth_required=m.auth_required,
        native=m.native,
        lookup_by_keys=m.lookup_by_keys,
        express_socket=m.express_socket,
        disk_path=m.disk_path,
        disk_inode=m.disk_inode,
        disk_map_size=m.disk_map_size,
        presence_offset=m.presence_offset,
        presence_bytes=m.presence_bytes,
        presence_nonce=m.presence_nonce,
    )


# -- failed calls ---------------------------------------------------------------------


def _reason(e: grpc.RpcError) -> str:
    trailers = getattr(e, "trailing_metadata", None)
    try:
        pairs = trailers() if callable(trailers) else None
    except Exception:  # an RpcError that never reached the server may not have any
        return ""
    for key, value in pairs or ():
        if key == ERROR_REASON_HEADER:
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return ""


def error_from_rpc(e: grpc.RpcError, what: str, target: str) -> errors.KVStoreError:
    """The kvstore error a client raises for a failed call (chain it with ``from e``)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else "") or str(code)
    return error_from_status(code, details, what, target, reason=_reason(e))


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def error_from_code(
    code: int, details: str, what: str, target: str, *, reason: str = ""
) -> errors.KVStoreError:
    """The error of a status given by its number: one failed item of a batch call
    (``CommitResponse.error_code``), or a failed call of the express plane."""
    status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
    return error_from_status(status, details, what, target, reason=reason)


def error_from_status(
    code: grpc.StatusCode, details: str, what: str, target: str, *, reason: str = ""
) -> errors.KVStoreError:
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    cls = errors.client_class(name, reason)
    if details.startswith(f"{what}: "):  # the server already named the method
        details = details[len(what) + 2 :]
    if cls is errors.ServerUnavailable:
        return cls(f"{what}: kvstore server at {target} is unavailable: {details}")
    return cls(f"{what}: {details} ({name})")
