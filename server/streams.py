"""The remote data plane: Put and Get streams, and how the service is registered.

Put and Get move payloads as raw frames (``kvstore.wire.frame``): the servicer
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
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import grpc
import xxhash

from kvstore.errors import CorruptRecord, InvalidArgument, KVStoreError, ResourceExhausted
from kvstore.keys import ChunkKey
from kvstore.records import RecordHeader, parse_header
from kvstore.store import TieredStore
from kvstore.tiers.arena import spans
from kvstore.tiers.base import PutStatus
from kvstore.tiers.memory import Reservation
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire import frame, unframe

log = logging.getLogger("kvstore.server")

SERVER_OWNER = "kvstore-server"  # owner of the holds the server takes for its own streams
Pieces = Iterator[tuple[int, memoryview]]


def pieces(raw: Iterator[bytes]) -> Pieces:
    """(field, value) of each raw PutRequest frame."""
    for buf in raw:
        yield unframe(buf, pb.PutRequest)


def _receive(
    parts: Pieces,
    header: RecordHeader,
    write: Callable[[int, memoryview], None],
    keepalive: Callable[[], None],
) -> int:
    size, pos = header.stored_size, 0
    for field, data in parts:
        if field != 2:
            raise InvalidArgument("only the first message of a Put stream carries a header")
        n = data.nbytes
        if pos + n > size:
            raise InvalidArgument(f"payload runs past the {size} bytes its header declares")
        write(pos, data)
        pos += n
        keepalive()
    if pos != size:
        raise InvalidArgument(f"payload is {pos} bytes, its header declares {size}")
    return pos


class _KeepAlive:
    """Renews a hold of the server's own while a slow stream is still moving."""

    def __init__(self, store: TieredStore, hid: int, lease_s: float) -> None:
        self.store, self.hid, self.every = store, hid, lease_s / 3
        self.last = time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last > self.every:
            self.store.memory.renew(self.hid)
            self.last = now


def receive_put(
    store: TieredStore, header: RecordHeader, parts: Pieces, lease_s: float
) -> PutStatus:
    """Store the payload streamed in ``parts`` under ``header``."""
    res = store.reserve(header, owner=SERVER_OWNER)  # validates before any payload is read
    if res == PutStatus.EXISTS:
        return PutStatus.EXISTS
    if isinstance(res, Reservation):
        arena, base = store.memory.arena, res.payload_offset
        try:
            _receive(
                parts,
                header,
                lambda pos, data: arena.write(res.extents, base + pos, data),
                _KeepAlive(store, res.id, lease_s),
            )
            return store.commit(res.id)
        except CorruptRecord as e:
            raise CorruptRecord(
                "payload checksum mismatch: the bytes were damaged on the way"
            ) from e
        finally:
            with contextlib.suppress(KVStoreError):
                store.abort(res.id)  # a no-op after a commit
    with _staging.take(header.stored_size, 2 * store.config.max_chunk_bytes):
        staged = bytearray(header.stored_size)  # L1 cannot take it: store.put writes below
        view = memoryview(staged)

        def write(pos: int, data: memoryview) -> None:
            view[pos : pos + data.nbytes] = data

        _receive(parts, header, write, lambda: None)
        if xxhash.xxh3_64_intdigest(staged) != header.payload_checksum:
            raise CorruptRecord("payload checksum mismatch: the bytes were damaged on the way")
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
    store: TieredStore, key: ChunkKey, piece: int, lease_s: float
) -> Generator[bytes, None, None]:
    """GetResponse frames of a chunk (header, then payload pieces); nothing on a miss."""
    lease = store.acquire(key, owner=SERVER_OWNER)
    if lease is not None:
        arena, extents, hs = store.memory.arena.array, lease.extents, lease.payload_offset
        keepalive = _KeepAlive(store, lease.id, lease_s)
        try:
            yield frame(1, lease.header.pack())
            size = lease.header.stored_size
            for off in range(0, size, piece):
                n = min(piece, size - off)
                yield frame(2, *(arena[o : o + k].data for o, _, k in spans(extents, hs + off, n)))
                keepalive()
        finally:
            with contextlib.suppress(KVStoreError):
                store.release(lease.id)
        return
    if key not in store.index:
        return  # a miss (acquire already looked in every tier)
    blob = store.get(key, count=False)  # stored below, and L1 could not take it now
    if blob is None:
        return
    view = memoryview(blob)
    hs = parse_header(view).header_size
    yield frame(1, view[:hs])
    for off in range(hs, len(view), piece):
        yield frame(2, view[off : off + piece])


class Watchdog:
    """Cancels streams that move nothing for ``idle_s`` (checked by ``sweep``).

    A stream handler holds a worker thread while it waits for the client: a client
    that opens a Put or Session stream and then sends nothing (hung, stopped, or
    hostile), or a Get whose reader stopped reading, would hold it forever, and a
    few dozen such streams would leave no thread for anyone else. Cancelling the
    call wakes the handler, which then ends like any broken stream.
    """

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[float, grpc.ServicerContext]] = {}
        self._ids = iter(range(1, 1 << 62))
        self.cancelled = 0

    def watch(self, context: grpc.ServicerContext) -> tuple[int, Callable[[], None]]:
        with self._lock:
            cid = next(self._ids)
            self._calls[cid] = (time.monotonic(), context)

        def touch() -> None:
            with self._lock:
                if cid in self._calls:
                    self._calls[cid] = (time.monotonic(), context)

        return cid, touch

    def done(self, cid: int) -> None:
        with self._lock:
            self._calls.pop(cid, None)

    def sweep(self) -> int:
        limit = time.monotonic() - self.idle_s
        with self._lock:
            idle = [(cid, ctx) for cid, (last, ctx) in self._calls.items() if last < limit]
            for cid, _ in idle:
                del self._calls[cid]
        for _, ctx in idle:
            ctx.cancel()
        if idle:
            log.info("cancelled %d streams idle for more than %.1f s", len(idle), self.idle_s)
        self.cancelled += len(idle)
        return len(idle)


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


def _parser(cls: Any) -> Callable[[bytes], Any]:
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
        request: Callable[[bytes], Any] | None = _parser(getattr(pb, m.input_type.name))
        response = getattr(pb, m.output_type.name).SerializeToString
        if m.name == "Put":
            request = None  # the servicer reads frames: kvstore.wire.unframe
        if m.name == "Get":
            response = _serialize  # the servicer yields frames: kvstore.wire.frame
        make = kinds[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(
            getattr(servicer, m.name), request_deserializer=request, response_serializer=response
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(desc.full_name, handlers),)
    )
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.62: faster dispatch
        server.add_registered_method_handlers(desc.full_name, handlers)
