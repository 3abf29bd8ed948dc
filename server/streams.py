"""The remote data plane: Put and Get streams, and how the service is registered.

Put and Get move payloads as raw frames (``kvstore.protocol.frame``): the servicer
gets each Put message as bytes and writes the payload straight from it into a
reservation in the L1 arena; Get reads a leased record out of the arena straight
into each frame. A payload is copied once on its way between the socket buffer
and the arena, not three times through protobuf messages and a staging buffer.
When L1 cannot take or lend the chunk (everything pinned or leased, or larger
than the arena), the bytes are staged in memory and go through ``store.put`` /
``store.get``, which use the lower tiers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from typing import Any

import grpc
import xxhash

from kvstore.arena import spans
from kvstore.engine.store import Reservation, TieredStore
from kvstore.errors import CorruptRecord, InvalidArgument, KVStoreError, ResourceExhausted
from kvstore.keys import ChunkKey
from kvstore.protocol import frame, unframe
from kvstore.records import RecordHeader, parse_header
from kvstore.types import PutStatus
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.server")

SERVER_OWNER = "kvstore-server"  # owner of the holds the server takes for its own streams
Pieces = Iterator[tuple[int, memoryview]]


def pieces(raw: Iterator[bytes]) -> Pieces:
    """(field, value) of each raw PutRequest frame."""
    for buf in raw:
        yield unframe(buf, pb.PutRequest)


def _receive(parts: Pieces, header: RecordHeader, write: Callable[[int, memoryview], None]) -> int:
    """Write the streamed payload piece by piece, hashing each piece as it lands (while it
    is in the CPU's caches): bytes damaged on the way fail here, before they are stored
    (a commit into L1 does not hash the payload; L1's readers do)."""
    size, pos = header.stored_size, 0
    digest = xxhash.xxh3_64()
    for field, data in parts:
        if field != 2:
            raise InvalidArgument("only the first message of a Put stream carries a header")
        n = data.nbytes
        if pos + n > size:
            raise InvalidArgument(f"payload runs past the {size} bytes its header declares")
        write(pos, data)
        digest.update(data)
        pos += n
    if pos != size:
        raise InvalidArgument(f"payload is {pos} bytes, its header declares {size}")
    if digest.intdigest() != header.payload_checksum:
        raise CorruptRecord("payload checksum mismatch: the bytes were damaged on the way")
    return pos


def receive_put(store: TieredStore, header: RecordHeader, parts: Pieces, watch: Watch) -> PutStatus:
    """Store the payload streamed in ``parts`` under ``header``.

    The reservation is a lasting one: it cannot expire while the stream, however slow,
    still writes into its pages (the watchdog ends a stream too slow for its size, and
    the ``finally`` below then gives the pages back). Only this thread ends it.
    """
    watch.expect(header.stored_size)
    # Validates before any payload is read.
    res = store.reserve(header, owner=SERVER_OWNER, lasting=True)
    if res == PutStatus.EXISTS:
        return PutStatus.EXISTS
    if isinstance(res, Reservation):
        arena, base = store.arena, res.payload_offset
        try:
            _receive(
                parts,
                header,
                lambda pos, data: arena.write(res.extents, base + pos, data),
            )
            return store.commit(res.id)
        finally:
            with contextlib.suppress(KVStoreError):
                store.abort(res.id)  # a no-op after a commit
    with _staging.take(header.stored_size, 2 * store.config.max_chunk_bytes):
        staged = bytearray(header.stored_size)  # L1 cannot take it: store.put writes below
        view = memoryview(staged)

        def write(pos: int, data: memoryview) -> None:
            view[pos : pos + data.nbytes] = data

        _receive(parts, header, write)
        return store.put(header, view)


class _Staging:
    """Bytes of Put streams staged in process memory, bounded so many large puts that
    L1 cannot take (a flood of them, say) cannot exhaust the server's memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.used = 0

    @contextlib.contextmanager
    def take(self, nbytes: int, limit: int) -> Iterator[None]:
        with self._lock:
            if self.used and self.used + nbytes > limit:
                raise ResourceExhausted(
                    f"the server is staging {self.used} bytes of puts that "
                    "L1 cannot take; retry later"
                )
            self.used += nbytes
        try:
            yield
        finally:
            with self._lock:
                self.used -= nbytes


_staging = _Staging()


def send_get(
    store: TieredStore, key: ChunkKey, piece: int, watch: Watch
) -> Generator[bytes, None, None]:
    """GetResponse frames of a chunk (header, then payload pieces); nothing on a miss.

    The read lease is a lasting one, released when the generator ends (or is closed):
    a reader that reads slowly keeps the pages it is being sent, for as long as the
    watchdog lets its stream live. Each frame is built from the arena (a copy) before
    it is yielded, while the lease still holds.
    """
    got = store.read(key, owner=SERVER_OWNER, lasting=True)
    if got is None:
        return  # a miss (every tier was asked)
    if not isinstance(got, bytes):
        lease = got
        arena, extents, hs = store.arena.array, lease.extents, lease.payload_offset
        try:
            size = lease.header.stored_size
            watch.expect(size)
            yield frame(1, lease.header.pack())
            for off in range(0, size, piece):
                n = min(piece, size - off)
                yield frame(2, *(arena[o : o + k].data for o, _, k in spans(extents, hs + off, n)))
        finally:
            with contextlib.suppress(KVStoreError):
                store.release(lease.id)
        return
    view = memoryview(got)  # stored below, and L1 could not take it now: read once
    hs = parse_header(view).header_size
    watch.expect(len(view) - hs)
    yield frame(1, view[:hs])
    for off in range(hs, len(view), piece):
        yield frame(2, view[off : off + piece])


class Watch:
    """One watched stream: ``touch`` on every message; ``expect`` once its size is known."""

    __slots__ = ("context", "deadline", "dog", "kind", "last", "started", "tenant")

    def __init__(
        self, dog: Watchdog, context: grpc.ServicerContext, kind: str, tenant: str | None
    ) -> None:
        self.dog, self.context, self.kind, self.tenant = dog, context, kind, tenant
        self.started = self.last = time.monotonic()
        self.deadline = math.inf

    def touch(self) -> None:
        self.last = time.monotonic()  # one float store: no lock on the per-message path

    def expect(self, nbytes: int) -> None:
        """The stream moves ``nbytes`` of payload: it must end by a deadline for that size."""
        self.deadline = self.started + self.dog.idle_s + nbytes / self.dog.min_rate


class Watchdog:
    """The table of live streams: cancels the idle and the too slow, bounds how many.

    A stream handler holds a worker thread while it waits for the client: a client
    that opens a Put or Session stream and then sends nothing (hung, stopped, or
    hostile), or a Get whose reader stopped reading, would hold it forever, and a
    few dozen such streams would leave no thread for anyone else. ``sweep`` cancels
    a stream that moved nothing for ``idle_s``, and a Put or Get that is still
    running ``idle_s + size / min_rate`` seconds after it began: a stream that
    trickles a byte now and then is never idle, but it is slow for its size.
    Cancelling the call wakes the handler, which then ends like any broken stream
    and gives back what it held (the server's holds for streams never expire on
    their own, so this bound is what keeps them finite).

    ``limits`` bounds the streams of each kind alive at once (``"data"``: Put and
    Get, ``"session"``: Session streams, which hold a thread for as long as their
    client lives): beyond it a new stream is refused with RESOURCE_EXHAUSTED before
    it reads anything, so the threads left over keep serving unary calls (Info,
    Stats, Lookup, the shared-memory plane) whatever the streams do. On a server with
    tenants no tenant holds more than ``tenant_share`` of a kind's streams, so one
    tenant (opening as many sessions as it likes) cannot take every slot from the others.
    """

    def __init__(
        self,
        idle_s: float,
        *,
        min_rate: float = 256 * 1024,
        limits: dict[str, tuple[int, str]] | None = None,
        tenant_share: float = 1.0,
    ) -> None:
        self.idle_s = idle_s
        self.min_rate = min_rate
        # kind -> (most streams alive at once, -1 for no bound; the setting that says so)
        self.limits = limits or {}
        self.tenant_share = tenant_share
        self._lock = threading.Lock()
        self._calls: dict[int, Watch] = {}
        self._ids = iter(range(1, 1 << 62))
        self._alive: Counter[str] = Counter()
        self._of_tenant: Counter[tuple[str, str]] = Counter()  # (kind, tenant) -> alive
        self.cancelled = 0
        self.too_slow = 0
        self.refused = 0

    def watch(
        self, context: grpc.ServicerContext, kind: str, tenant: str | None = None
    ) -> tuple[int, Watch]:
        """Start watching a stream of ``kind`` (opened by ``tenant``, None: no tenant);
        ResourceExhausted past its limit, or past the tenant's share of it."""
        w = Watch(self, context, kind, tenant)
        most, setting = self.limits.get(kind, (-1, ""))
        with self._lock:
            if most >= 0 and self._alive[kind] >= most:
                self.refused += 1
                raise ResourceExhausted(
                    f"{self._alive[kind]} {kind} streams are running, the most this server "
                    f"takes ({setting}); retry later"
                )
            if tenant is not None:
                mine = max(1, int(most * self.tenant_share))
                if most >= 0 and self._of_tenant[kind, tenant] >= mine:
                    self.refused += 1
                    raise ResourceExhausted(
                        f"tenant {tenant} runs {mine} {kind} streams, its share of the "
                        f"{most} this server takes (tenant_stream_share={self.tenant_share:g}); "
                        "retry later"
                    )
                self._of_tenant[kind, tenant] += 1
            self._alive[kind] += 1
            cid = next(self._ids)
            self._calls[cid] = w
        return cid, w

    def _ended(self, w: Watch) -> None:
        """Caller holds ``_lock``."""
        self._alive[w.kind] -= 1
        if w.tenant is not None:  # counted in watch, whatever the limit
            self._of_tenant[w.kind, w.tenant] -= 1
            if not self._of_tenant[w.kind, w.tenant]:
                del self._of_tenant[w.kind, w.tenant]

    def done(self, cid: int) -> None:
        with self._lock:
            w = self._calls.pop(cid, None)
            if w is not None:
                self._ended(w)

    def sweep(self) -> int:
        now = time.monotonic()
        idle_before = now - self.idle_s
        with self._lock:
            idle = [cid for cid, w in self._calls.items() if w.last < idle_before]
            slow = [cid for cid, w in self._calls.items() if w.deadline < now and cid not in idle]
            ended = [self._calls.pop(cid) for cid in idle + slow]
            for w in ended:
                self._ended(w)
        for w in ended:
            w.context.cancel()
        if idle:
            log.info("cancelled %d streams idle for more than %.1f s", len(idle), self.idle_s)
        if slow:
            log.warning(
                "cancelled %d Put/Get streams slower than %d bytes/s for their size",
                len(slow),
                int(self.min_rate),
            )
        self.cancelled += len(ended)
        self.too_slow += len(slow)
        return len(ended)


def touching(it: Iterator[Any], touch: Callable[[], None]) -> Iterator[Any]:
    for item in it:
        touch()
        if isinstance(item, Undecodable):
            raise InvalidArgument(item.message)
        yield item


def _serialize(msg: Any) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


class Undecodable:
    """A request message protobuf could not parse (bad wire format, invalid UTF-8 in a
    string). gRPC would answer INTERNAL "Exception deserializing request!" and log a
    traceback for each; the servicer answers INVALID_ARGUMENT saying why instead."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = f"unreadable {type_name} message: {error}"


def request_parser(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # protobuf's DecodeError, or a RuntimeWarning turned error
            return Undecodable(cls.__name__, e)

    return parse


def add_to_server(servicer: Any, server: grpc.Server) -> None:
    """Register the KVStore service, with raw frames for the Put requests and Get responses."""
    desc = pb.DESCRIPTOR.services_by_name["KVStore"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for m in desc.methods:
        request: Callable[[bytes], Any] | None = request_parser(getattr(pb, m.input_type.name))
        response = getattr(pb, m.output_type.name).SerializeToString
        if m.name == "Put":
            request = None  # the servicer reads frames: kvstore.protocol.unframe
        if m.name == "Get":
            response = _serialize  # the servicer yields frames: kvstore.protocol.frame
        make = kinds[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(
            getattr(servicer, m.name), request_deserializer=request, response_serializer=response
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(desc.full_name, handlers),)
    )
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.62: faster dispatch
        server.add_registered_method_handlers(desc.full_name, handlers)
