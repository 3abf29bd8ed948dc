"""What both ends of the wire agree on besides the .proto: the core's half of the protocol.

The server and the SDK both import this module (and neither imports the other),
so a value crosses the wire the same way in both directions: metadata names and
defaults, the batch limits, ``PutStatus`` <-> proto enum, ``keys.Namespace`` <->
proto ``Namespace``, ``LookupResult``, ``StoreStats`` and ``ChunkView`` <-> their
messages, the raw payload frames of Put and Get, and the gRPC status a server
sends for each kvstore error. What only a client needs (reading a failed call
back into an error, the Info and Namespaces views) is the SDK's, ``kvstore.sdk.wire``.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import grpc

from kvstore import errors
from kvstore.keys import ChunkKey, Fingerprint, Namespace
from kvstore.types import (
    ChunkMatches,
    ChunkView,
    LookupResult,
    NamespaceMatch,
    PutStatus,
    StoreStats,
    TierStats,
)
from kvstore.v1 import kvstore_pb2 as pb

DEFAULT_PORT = 50551
SESSION_HEADER = "x-kvstore-session"  # metadata: the client's session id (lease owner)
AUTH_HEADER = "authorization"  # metadata: "Bearer <token>"
ERROR_REASON_HEADER = "x-kvstore-error-reason"  # trailing metadata: KVStoreError.reason
SERVICE_NAME = "kvstore.v1.KVStore"
MAX_RESERVE_BATCH = 1024  # items in one ReserveMany, CommitMany or AcquireMany (the .proto's)


def default_socket_path() -> str:
    """The Unix socket a server listens on and a client dials when told nothing else."""
    return os.path.join(tempfile.gettempdir(), f"kvstore-{os.getuid()}", "kvstore.sock")


def boot_id() -> str:
    """This host's boot id: with the arena's inode it proves a client shares the server's host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


# -- put status ------------------------------------------------------------------------

_STATUS_TO_PB: dict[PutStatus, pb.PutStatus] = {
    PutStatus.STORED: pb.STORED,
    PutStatus.EXISTS: pb.EXISTS,
    PutStatus.FULL: pb.FULL,
    PutStatus.TOO_LARGE: pb.TOO_LARGE,
    PutStatus.UNAVAILABLE: pb.UNAVAILABLE,
}
_STATUS_FROM_PB: dict[int, PutStatus] = {int(v): k for k, v in _STATUS_TO_PB.items()}


def status_to_pb(status: PutStatus) -> pb.PutStatus:
    return _STATUS_TO_PB[status]


def status_from_pb(value: int) -> PutStatus:
    try:
        return _STATUS_FROM_PB[value]
    except KeyError:
        raise errors.ServerError(f"server sent an unknown put status {value}") from None


# -- namespaces ------------------------------------------------------------------------


def namespace_to_pb(ns: Namespace) -> pb.Namespace:
    return pb.Namespace(
        model=ns.model,
        revision=ns.revision,
        dtype=ns.dtype,
        layout=ns.layout,
        device=ns.device,
        tp_rank=ns.tp_rank,
        tp_size=ns.tp_size,
        pp_rank=ns.pp_rank,
        pp_size=ns.pp_size,
        lora=ns.lora,
        salt=ns.salt,
        extra=dict(ns.extra),
    )


def namespace_from_pb(msg: pb.Namespace) -> Namespace:
    """A Namespace from its message; raises InvalidArgument for an invalid one."""
    return Namespace(
        model=msg.model,
        revision=msg.revision,
        dtype=msg.dtype,
        layout=msg.layout,
        device=msg.device,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
        pp_rank=msg.pp_rank,
        pp_size=msg.pp_size or 1,
        lora=msg.lora,
        salt=msg.salt,
        extra=tuple(sorted(msg.extra.items())),
    )


# -- lookup ----------------------------------------------------------------------------


def lookup_to_pb(result: LookupResult) -> pb.LookupResponse:
    msg = pb.LookupResponse(
        matched_tokens=result.matched_tokens,
        total_tokens=result.total_tokens,
        stop=result.stop,
        stop_chunk=result.stop_chunk,
        tokens_by_tier=result.by_tier,
        other_namespaces=[
            pb.NamespaceMatch(
                fingerprint=o.fingerprint,
                matched_tokens=o.matched_tokens,
                namespace=namespace_to_pb(o.namespace) if o.namespace else None,
            )
            for o in result.other_namespaces
        ],
    )
    if result.chunks:
        m = ChunkMatches.of(result.chunks)
        c = msg.chunks
        c.keys = m.key_bytes
        c.start[:] = m.start
        c.tokens[:] = m.tokens
        c.stored_tokens[:] = m.stored_tokens
        c.tier[:] = m.tier
        c.partial[:] = m.partial
    return msg


def lookup_from_pb(msg: pb.LookupResponse) -> LookupResult:
    return LookupResult(
        matched_tokens=msg.matched_tokens,
        total_tokens=msg.total_tokens,
        chunks=_chunks_from_pb(msg.chunks),
        stop=msg.stop,
        stop_chunk=msg.stop_chunk,
        by_tier=dict(msg.tokens_by_tier),
        other_namespaces=tuple(
            NamespaceMatch(
                Fingerprint(o.fingerprint),
                o.matched_tokens,
                _maybe_namespace(o.namespace) if o.HasField("namespace") else None,
            )
            for o in msg.other_namespaces
        ),
    )


def _chunks_from_pb(c: pb.ChunkMatches) -> ChunkMatches:
    # The message's own columns (rows are made as they are read): a 128k-token prompt
    # has 512 rows, and making them, or lists of the columns, costs more than the RPC.
    try:
        tier = bytes(c.tier)  # ValueError past 255: not a tier
        return ChunkMatches(c.keys, c.start, c.tokens, c.stored_tokens, tier, c.partial)
    except ValueError as e:
        raise errors.KVStoreError(f"malformed lookup response: {e}") from e


def _maybe_namespace(msg: pb.Namespace) -> Namespace | None:
    try:
        return namespace_from_pb(msg)
    except errors.InvalidArgument:
        return None


# -- stats and listings ----------------------------------------------------------------


def stats_to_pb(
    stats: StoreStats,
    *,
    active_leases: int,
    uptime_s: int,
    requests: dict[str, int] | None = None,
) -> pb.StatsResponse:
    return pb.StatsResponse(
        chunks=stats.chunks,
        namespaces=stats.namespaces,
        tiers=[
            pb.TierStats(
                name=t.name,
                level=t.level,
                capacity_bytes=t.capacity_bytes,
                used_bytes=t.used_bytes,
                chunks=t.chunks,
                hits=t.hits,
                misses=t.misses,
                puts=t.puts,
                evictions=t.evictions,
                corrupt=t.corrupt,
                errors=t.errors,
                rejected=t.rejected,
                bytes_in=t.bytes_in,
                bytes_out=t.bytes_out,
                healthy=t.healthy,
                detail_json=json.dumps(t.detail, default=str, sort_keys=True),
            )
            for t in stats.tiers
        ],
        pending_writes=stats.pending_writes,
        pending_bytes=stats.pending_bytes,
        write_failures=stats.write_failures,
        lookups=stats.lookups,
        lookup_tokens=stats.lookup_tokens,
        matched_tokens=stats.matched_tokens,
        gets=stats.gets,
        hits=stats.hits,
        puts=stats.puts,
        rejected_puts=stats.rejected_puts,
        dropped=stats.dropped,
        drops_deferred=stats.drops_deferred,
        active_leases=active_leases,
        uptime_s=uptime_s,
        requests=requests or {},
    )


def stats_from_pb(msg: pb.StatsResponse) -> StoreStats:
    """The server's StoreStats; ``extra`` holds active_leases, uptime_s and requests (the
    server's finished calls by method, as ``KVStoreService.request_counts``)."""
    tiers = []
    for t in msg.tiers:
        try:
            detail: dict[str, Any] = json.loads(t.detail_json) if t.detail_json else {}
        except ValueError:
            detail = {"raw": t.detail_json}
        tiers.append(
            TierStats(
                t.name,
                t.level,
                t.capacity_bytes,
                used_bytes=t.used_bytes,
                chunks=t.chunks,
                hits=t.hits,
                misses=t.misses,
                puts=t.puts,
                evictions=t.evictions,
                corrupt=t.corrupt,
                errors=t.errors,
                rejected=t.rejected,
                bytes_in=t.bytes_in,
                bytes_out=t.bytes_out,
                healthy=t.healthy,
                detail=detail,
            )
        )
    return StoreStats(
        chunks=msg.chunks,
        namespaces=msg.namespaces,
        tiers=tiers,
        pending_writes=msg.pending_writes,
        pending_bytes=msg.pending_bytes,
        write_failures=msg.write_failures,
        lookups=msg.lookups,
        lookup_tokens=msg.lookup_tokens,
        matched_tokens=msg.matched_tokens,
        gets=msg.gets,
        hits=msg.hits,
        puts=msg.puts,
        rejected_puts=msg.rejected_puts,
        dropped=msg.dropped,
        drops_deferred=msg.drops_deferred,
        extra={
            "active_leases": msg.active_leases,
            "uptime_s": msg.uptime_s,
            "requests": dict(msg.requests),
        },
    )


def chunk_to_pb(v: ChunkView) -> pb.ChunkInfo:
    return pb.ChunkInfo(
        key=v.key,
        fingerprint=v.fingerprint,
        parent=v.parent,
        n_tokens=v.n_tokens,
        raw_size=v.raw_size,
        dtype=v.dtype,
        tiers=list(v.tiers),
        pinned=v.pinned,
        created_ms=v.created_ms,
        last_access_ms=v.last_access_ms,
        hits=v.hits,
    )


def chunk_from_pb(m: pb.ChunkInfo) -> ChunkView:
    return ChunkView(
        key=ChunkKey(m.key),
        fingerprint=Fingerprint(m.fingerprint),
        parent=ChunkKey(m.parent),
        n_tokens=m.n_tokens,
        raw_size=m.raw_size,
        dtype=m.dtype,
        tiers=tuple(m.tiers),
        pinned=m.pinned,
        created_ms=m.created_ms,
        last_access_ms=m.last_access_ms,
        hits=m.hits,
    )


# -- errors <-> statuses ---------------------------------------------------------------
# Each kvstore error names its own status (``code``, and where needed a ``reason``
# in the trailing metadata; kvstore/errors.py); these are the gRPC half of that.


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a server returns for an exception raised while serving a call."""
    if isinstance(exc, errors.KVStoreError):
        return grpc.StatusCode[exc.code], str(exc) or type(exc).__name__
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error ({type(exc).__name__}: {exc}); see the server log",
    )


def error_trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a server sends with ``status_of(exc)``: the error's reason, if any."""
    reason = exc.reason if isinstance(exc, errors.KVStoreError) else ""
    return ((ERROR_REASON_HEADER, reason),) if reason else ()


# -- payload frames ----------------------------------------------------------------------
# PutRequest and GetResponse pieces are messages with one length-delimited field
# (1 header, 2 data). Both ends build and take them apart by hand: the payload is
# then copied once into the frame and read in place out of it, instead of going
# through a protobuf message (two more copies of every byte). Anything that is not
# exactly one such field falls back to the protobuf parser.


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def frame(field: int, *parts: bytes | memoryview) -> bytes:
    """The serialized message holding ``b"".join(parts)`` in length-delimited ``field``."""
    n = sum(memoryview(p).nbytes for p in parts)
    return b"".join((bytes((field << 3 | 2,)), _varint(n), *parts))


def unframe(buf: bytes, cls: type[pb.PutRequest] | type[pb.GetResponse]) -> tuple[int, memoryview]:
    """(field number, value) of one PutRequest/GetResponse frame; the value is not copied.

    Field 0 means no field was set. Raises InvalidArgument for an unreadable message.
    """
    mv = memoryview(buf)
    if not mv:
        return 0, mv
    tag, pos, n, shift = mv[0], 1, 0, 0
    while pos < len(mv) and shift < 35:
        b = mv[pos]
        n |= (b & 0x7F) << shift
        pos += 1
        shift += 7
        if not b & 0x80:
            break
    if tag in (0x0A, 0x12) and pos + n == len(mv) and not mv[pos - 1] & 0x80:
        return tag >> 3, mv[pos:]
    try:  # not the one-field shape this module writes: let protobuf decide
        msg = cls.FromString(bytes(mv))
    except Exception as e:  # protobuf raises its own DecodeError
        raise errors.InvalidArgument(f"unreadable {cls.__name__} message: {e}") from e
    which = msg.WhichOneof("part")
    if which is None:
        return 0, memoryview(b"")
    return (1 if which == "header" else 2), memoryview(getattr(msg, which))
