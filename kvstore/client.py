"""The blocking Python SDK of kvstore-server: ``kvstore.Client``.

    with kvstore.Client("unix:///tmp/kvstore-1000/kvstore.sock") as kv:
        key, status = kv.put_chunk(namespace, ROOT, tokens, payload, "bfloat16", shape)
        header, data = kv.get(key)
        kv.lookup(namespace, prompt_tokens).matched_tokens

URLs: ``grpc://host:port``, ``grpcs://host:port`` (TLS; ``tls_ca=`` names the CA),
``unix:///path``; default ``$KVSTORE_URL``, else the server's default Unix socket.
The token defaults to ``$KVSTORE_TOKEN``.

Two data planes, one API. On the server's host (the client can open the
server's arena file and its boot id and inode match) chunk bytes go through
shared memory: put = Reserve, copy into the arena, Commit; get = Acquire, copy
out (or read in place with ``acquire``), Release. Only control messages cross
gRPC. Elsewhere the payload is streamed with Put/Get in pieces. ``shm=None``
picks automatically; ``True`` insists, ``False`` never maps. A background
Session stream keeps this client's leases alive; when the client closes or
dies the server drops them, so a crashed client cannot pin arena pages.

Every call has a deadline (``timeout=``, default from the constructor) and
raises ``kvstore.errors`` classes: ``ServerUnavailable``, ``Unauthenticated``,
``InvalidArgument``, ``NotFound``, ``CorruptRecord``, ``DeadlineExceeded``,
``ResourceExhausted``, ``ServerError``. Misses are ``None``, not exceptions.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import xxhash

from kvstore.errors import CorruptRecord, InvalidArgument, KVStoreError, ServerError
from kvstore.keys import FINGERPRINT_BYTES, ChunkKey, Fingerprint, Namespace, chunk_key
from kvstore.keys import tokens_to_bytes as _tokens_to_bytes
from kvstore.lookup import LookupResult
from kvstore.records import Codec, RecordHeader, make_header, parse_header
from kvstore.store import ChunkView, StoreStats
from kvstore.tiers.arena import ArenaView, as_u8, spans
from kvstore.tiers.base import PutStatus
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import (
    AUTH_HEADER,
    DEFAULT_PORT,
    SERVICE_NAME,
    SESSION_HEADER,
    NamespaceInfo,
    ServerInfo,
    boot_id,
    chunk_from_pb,
    error_from_rpc,
    frame,
    info_from_pb,
    lookup_from_pb,
    namespace_from_pb,
    namespace_to_pb,
    stats_from_pb,
    status_from_pb,
    unframe,
)

log = logging.getLogger("kvstore.client")

T = TypeVar("T")
NamespaceLike = Namespace | Fingerprint | bytes
Tokens = Sequence[int] | np.ndarray
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


@dataclass(frozen=True)
class Endpoint:
    url: str
    target: str  # what grpc dials
    tls: bool


def parse_url(url: str | None = None) -> Endpoint:
    """grpc://host[:port], grpcs://host[:port], unix:///path, or a bare host:port."""
    from kvstore.wire import default_socket_path

    url = url or os.environ.get("KVSTORE_URL") or f"unix://{default_socket_path()}"
    if url.startswith("unix://") or url.startswith("unix:"):
        path = url[len("unix://"):] if url.startswith("unix://") else url[len("unix:"):]
        if not path:
            raise InvalidArgument(f"{url!r}: a unix URL needs a path, e.g. unix:///tmp/kv.sock")
        return Endpoint(url, f"unix:{path}", False)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "grpc", url
    if scheme not in ("grpc", "grpcs") or not rest or "/" in rest.rstrip("/"):
        raise InvalidArgument(f"{url!r}: expected grpc://host:port, grpcs://host:port or "
                              "unix:///path")
    rest = rest.rstrip("/")
    if not rest.rsplit("]", 1)[-1].count(":"):
        rest = f"{rest}:{DEFAULT_PORT}"
    return Endpoint(url, rest, scheme == "grpcs")


def namespace_fingerprint(ns: NamespaceLike) -> tuple[Fingerprint, Namespace | None]:
    if isinstance(ns, Namespace):
        return ns.fingerprint, ns
    if isinstance(ns, (bytes, bytearray)) and len(ns) == FINGERPRINT_BYTES:
        return Fingerprint(bytes(ns)), None
    raise InvalidArgument(f"expected a kvstore.keys.Namespace or a {FINGERPRINT_BYTES}-byte "
                          f"fingerprint, got {type(ns).__name__}")


def chunk_header(ns: NamespaceLike, parent: ChunkKey, tokens: Tokens, payload: Any, dtype: str,
                 shape: Sequence[int]) -> RecordHeader:
    """The record header of one chunk (keys.chunk_key over parent, namespace and tokens)."""
    fp, _ = namespace_fingerprint(ns)
    tb = _tokens_to_bytes(tokens)
    return make_header(key=chunk_key(parent, fp, tb), parent=parent, fingerprint=fp,
                       token_bytes=tb, dtype=dtype, shape=shape, payload=as_u8(payload).data)


def read_tls_ca(tls_ca: str | bytes | None) -> bytes | None:
    if tls_ca is None or isinstance(tls_ca, bytes):
        return tls_ca
    try:
        with open(os.path.expanduser(tls_ca), "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(f"tls_ca={tls_ca!r}: cannot read it: {e}") from e


class Lease:
    """A read lease on a chunk in the server's arena: read in place, then release.

    The views stay valid (the pages cannot move or be reused) until ``release``;
    after that they may show another chunk's bytes.
    """

    def __init__(self, header: RecordHeader, lease_id: int, extents: list[tuple[int, int]],
                 payload_offset: int, arena: ArenaView,
                 release: Callable[[int], bool], valid_until: float = 0.0) -> None:
        self.header = header
        self.id = lease_id
        # Monotonic time before which the lease surely holds: measured from before the
        # Acquire was sent, with a margin, so no answer from the server is needed.
        self.valid_until = valid_until
        self._extents, self._offset, self._arena = extents, payload_offset, arena
        self._release = release
        self.released = False

    def views(self) -> list[memoryview]:
        """The payload as memoryviews into the arena, in order (zero copy)."""
        arr = self._arena.array
        return [arr[off : off + n].data for off, _, n in
                spans(self._extents, self._offset, self.header.raw_size)]

    def read_into(self, out: Any) -> None:
        if self.released:
            raise InvalidArgument("lease already released")
        dst = as_u8(out, writable=True)
        if dst.size < self.header.raw_size:
            raise InvalidArgument(f"output buffer holds {dst.size} bytes, the payload is "
                                  f"{self.header.raw_size}")
        self._arena.read_into(self._extents, self._offset, dst[: self.header.raw_size])

    def read(self) -> bytes:
        if self.released:
            raise InvalidArgument("lease already released")
        return self._arena.read(self._extents, self._offset, self.header.raw_size)

    def release(self) -> bool:
        """End the lease; False if it had expired (then discard what was read)."""
        if self.released:
            return True
        self.released = True
        return self._release(self.id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def prefault(arena: ArenaView, stop: threading.Event, step: int = 32 << 20) -> None:
    """Map every page of the arena into this process ahead of use (run on a daemon thread).

    The first write to a page of a fresh mapping costs a page fault, several
    times the copy itself; MADV_POPULATE_WRITE takes them all up front. ctypes
    drops the GIL around the call, so the client's own work goes on meanwhile.
    Where the kernel lacks it, pages are faulted on first use as before.
    """
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        base = arena.array.ctypes.data
    except (OSError, AttributeError, KVStoreError):
        return
    for off in range(0, arena.size, step):
        if stop.is_set() or arena.closed:
            return
        if madvise(base + off, min(step, arena.size - off), _MADV_POPULATE_WRITE) != 0:
            return


LEASE_MARGIN = 0.5  # a lease is trusted for this share of its length, client-side
PUT_METHOD = f"/{SERVICE_NAME}/Put"
GET_METHOD = f"/{SERVICE_NAME}/Get"


class _Assembler:
    """Takes apart the frames of a Get stream: the header, then the payload pieces."""

    def __init__(self, key: bytes, out: np.ndarray | None) -> None:
        self.key, self.out = key, out
        self.header: RecordHeader | None = None
        self.pieces: builtins.list[memoryview] = []
        self.pos = 0
        self.hash = xxhash.xxh3_64()

    def add(self, raw: bytes) -> None:
        field, data = unframe(raw, pb.GetResponse)
        if self.header is None:
            if field != 1:
                raise ServerError("the Get stream did not start with a record header")
            self.header = parse_header(data, expect_key=self.key)
            if self.out is not None and self.out.size < self.header.raw_size:
                raise InvalidArgument(f"output buffer holds {self.out.size} bytes, the payload "
                                      f"is {self.header.raw_size}")
            return
        n = data.nbytes
        if field != 2 or self.pos + n > self.header.raw_size:
            raise CorruptRecord(f"the Get stream of {self.key.hex()[:16]} runs past its payload")
        self.hash.update(data)
        if self.out is not None:
            self.out[self.pos : self.pos + n] = np.frombuffer(data, np.uint8)
        else:
            self.pieces.append(data)
        self.pos += n

    def finish(self) -> tuple[RecordHeader, bytes] | None:
        """The header and payload (b"" when it went into ``out``), or None on a miss."""
        h = self.header
        if h is None:
            return None
        if self.pos != h.raw_size:
            raise CorruptRecord(f"the Get stream ended after {self.pos} payload bytes, "
                                f"expected {h.raw_size}")
        if self.hash.intdigest() != h.payload_checksum:
            raise CorruptRecord("payload from the Get stream fails its checksum")
        return h, (b"".join(self.pieces) if self.out is None else b"")


class _Base:
    """What the blocking and the asyncio client share: settings, arena checks, messages."""

    def __init__(self, url: str | None, *, token: str | None, tls_ca: str | bytes | None,
                 tls_server_name: str | None, timeout: float, shm: bool | None,
                 verify: bool) -> None:
        self.endpoint = parse_url(url)
        self.url = self.endpoint.url
        self.timeout = timeout
        self.verify = verify
        self.session_id = uuid.uuid4().hex
        token = token if token is not None else os.environ.get("KVSTORE_TOKEN", "")
        self._metadata: tuple[tuple[str, str], ...] = ((SESSION_HEADER, self.session_id),)
        if token:
            self._metadata += ((AUTH_HEADER, f"Bearer {token}"),)
        self._shm_pref = shm
        self._ca = read_tls_ca(tls_ca)
        self._options = list(CHANNEL_OPTIONS)
        if tls_server_name:
            self._options.append(("grpc.ssl_target_name_override", tls_server_name))
        self._info: ServerInfo | None = None
        self._arena: ArenaView | None = None
        self._shm_checked = False  # Info looked at and the arena opened (or refused)
        self._closed = False
        self._prefault_stop = threading.Event()

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._ca)

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _error(self, e: grpc.RpcError, what: str) -> KVStoreError:
        return error_from_rpc(e, what, self.url)

    def _open_arena(self, info: ServerInfo) -> ArenaView | None:
        """The server's arena if this client shares its host and may map it."""
        if self._shm_pref is False:
            return None
        why = ""
        if not info.shm_path:
            why = "the server does not offer shared memory"
        elif not info.boot_id or info.boot_id != boot_id():
            why = "the server runs on another host (boot ids differ)"
        else:
            try:
                st = os.stat(info.shm_path)
                if st.st_ino != info.shm_inode:
                    why = f"{info.shm_path} here is not the server's arena (inode differs)"
                else:
                    arena = ArenaView.open(info.shm_path, info.shm_size, writable=True)
                    threading.Thread(target=prefault, args=(arena, self._prefault_stop),
                                     name="kvstore-prefault", daemon=True).start()
                    return arena
            except (OSError, KVStoreError) as e:
                why = f"cannot map {info.shm_path}: {e}"
        if self._shm_pref:
            raise KVStoreError(f"shared memory was requested (shm=True) but cannot be used: {why}")
        log.debug("shared memory not used: %s", why)
        return None

    def _check_extents(self, extents: Iterable[pb.Extent]) -> list[tuple[int, int]]:
        assert self._arena is not None
        out = [(e.offset, e.length) for e in extents]
        if any(o + n > self._arena.size for o, n in out):
            raise ServerError("the server handed out extents beyond its arena (did it restart?)")
        return out

    def _check_put(self, header: RecordHeader, payload: Any) -> np.ndarray:
        src = as_u8(payload)
        if header.codec != Codec.RAW:
            raise InvalidArgument("put takes raw payloads; the server picks codecs per tier")
        if src.size != header.stored_size:
            raise InvalidArgument(f"payload is {src.size} bytes, its header says "
                                  f"{header.stored_size}")
        info = self._info
        if info is not None and header.record_size > info.max_chunk_bytes:
            raise InvalidArgument(f"record of {header.record_size} bytes exceeds the server's "
                                  f"max_chunk_bytes={info.max_chunk_bytes}")
        return src

    def _put_frames(self, header: RecordHeader, src: np.ndarray) -> Iterator[bytes]:
        """Put messages as raw frames (kvstore.wire.frame): one copy of each piece."""
        yield frame(1, header.pack())
        piece = self._info.piece_bytes if self._info else 1 << 20
        mv = src.data
        for off in range(0, len(mv), piece):
            yield frame(2, mv[off : off + piece])

    @staticmethod
    def _lookup_request(ns: NamespaceLike, tokens: Tokens, min_tokens: int, granularity: int,
                        explain: bool) -> pb.LookupRequest:
        fp, named = namespace_fingerprint(ns)
        return pb.LookupRequest(
            fingerprint=fp, token_ids=_tokens_to_bytes(tokens), min_tokens=min_tokens,
            granularity=granularity, explain=explain,
            namespace=namespace_to_pb(named) if named is not None else None,
        )

    @staticmethod
    def _clear_request(namespace: NamespaceLike | None, all: bool) -> pb.ClearRequest:
        if (namespace is None) == (not all):
            raise InvalidArgument("clear needs a namespace or all=True (not both)")
        fp = namespace_fingerprint(namespace)[0] if namespace is not None else b""
        return pb.ClearRequest(fingerprint=fp, all=all)

    @staticmethod
    def _list_request(namespace: NamespaceLike | None, tier: int, pinned_only: bool,
                      page_size: int, token: str) -> pb.ListRequest:
        fp = namespace_fingerprint(namespace)[0] if namespace is not None else b""
        return pb.ListRequest(fingerprint=fp, tier=tier, pinned_only=pinned_only,
                              page_size=page_size, page_token=token)

    @staticmethod
    def _namespaces(msg: pb.NamespacesResponse) -> list[NamespaceInfo]:
        out = []
        for n in msg.namespaces:
            named = None
            if n.HasField("namespace"):
                try:
                    named = namespace_from_pb(n.namespace)
                except InvalidArgument:
                    named = None
            out.append(NamespaceInfo(Fingerprint(n.fingerprint), n.chunks, n.bytes, named))
        return out

    def _ping_interval(self) -> float:
        lease_ms = self._info.lease_ms if self._info else 30_000
        return max(0.05, min(lease_ms / 3000.0, 5.0))


class Client(_Base):
    """A blocking client of kvstore-server; thread-safe. See the module docstring."""

    def __init__(self, url: str | None = None, *, token: str | None = None,
                 tls_ca: str | bytes | None = None, tls_server_name: str | None = None,
                 timeout: float = 10.0, shm: bool | None = None, verify: bool = False) -> None:
        """``verify``: also checksum what is read from shared memory (the server verified it
        when it handed out the lease; this catches a rogue writer on the host)."""
        super().__init__(url, token=token, tls_ca=tls_ca, tls_server_name=tls_server_name,
                         timeout=timeout, shm=shm, verify=verify)
        ep = self.endpoint
        self._channel = (grpc.secure_channel(ep.target, self._credentials(), self._options)
                         if ep.tls else grpc.insecure_channel(ep.target, self._options))
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._put_raw = self._channel.stream_unary(
            PUT_METHOD, request_serializer=None, response_deserializer=pb.PutResponse.FromString)
        self._get_raw = self._channel.unary_stream(
            GET_METHOD, request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=None)
        self._lock = threading.Lock()
        self._pending: set[grpc.Future] = set()  # Releases sent without waiting
        self._stop = threading.Event()
        self._session: threading.Thread | None = None

    # -- plumbing -------------------------------------------------------------------------
    def _call(self, what: str, method: Callable[..., T], request: Any,
              timeout: float | None) -> T:
        if self._closed:
            raise KVStoreError("the client is closed")
        try:
            return method(request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, what) from e

    def _shm(self) -> ArenaView | None:
        """The mapped arena if the shared-memory plane is in use (set up on first use)."""
        if self._shm_checked and (self._session is None or self._session.is_alive()):
            return self._arena
        with self._lock:
            if self._shm_checked and self._session is not None and not self._session.is_alive():
                self._reset_shm()  # the Session ended: the server may have restarted
            if not self._shm_checked:
                info = self.info()
                self._arena = self._open_arena(info)
                if self._arena is not None:
                    self._start_session()
                self._shm_checked = True
            return self._arena

    def _reset_shm(self) -> None:
        if self._arena is not None:
            self._arena.close()
        self._arena, self._session, self._shm_checked = None, None, False

    def _start_session(self) -> None:
        interval = self._ping_interval()

        def pings() -> Iterator[pb.SessionPing]:
            yield pb.SessionPing(owner=self.session_id)
            while not self._stop.wait(interval):
                yield pb.SessionPing(owner=self.session_id)

        def run() -> None:
            try:
                for _ in self._stub.Session(pings(), metadata=self._metadata):
                    pass
            except grpc.RpcError as e:
                if not self._stop.is_set():
                    log.debug("session stream ended: %s", e)

        self._session = threading.Thread(target=run, name="kvstore-session", daemon=True)
        self._session.start()

    @property
    def shm_active(self) -> bool:
        """True when chunk bytes travel through the server's shared memory."""
        return self._shm() is not None

    # -- server --------------------------------------------------------------------------
    def info(self, *, timeout: float | None = None) -> ServerInfo:
        self._info = info_from_pb(self._call("Info", self._stub.Info, pb.InfoRequest(), timeout))
        return self._info

    def health(self, *, timeout: float | None = None) -> bool:
        """True when the server answers its health check with SERVING (no token needed)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                timeout=self._deadline(timeout))
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    def stats(self, *, timeout: float | None = None) -> StoreStats:
        return stats_from_pb(self._call("Stats", self._stub.Stats, pb.StatsRequest(), timeout))

    # -- writes ----------------------------------------------------------------------------
    def put(self, header: RecordHeader, payload: Any, *, timeout: float | None = None
            ) -> PutStatus:
        """Store one chunk (raw payload: bytes, memoryview, numpy array...)."""
        if self._info is None:
            self.info(timeout=timeout)
        src = self._check_put(header, payload)
        arena = self._shm()
        if arena is not None:
            status = self._put_shm(header, src, timeout)
            if status is not None:
                return status
        return self._put_stream(header, src, timeout)

    def _put_shm(self, header: RecordHeader, src: np.ndarray, timeout: float | None
                 ) -> PutStatus | None:
        r = self._call("Reserve", self._stub.Reserve, pb.ReserveRequest(header=header.pack()),
                       timeout)
        status = status_from_pb(r.status)
        if status != PutStatus.STORED:
            # FULL/TOO_LARGE for L1: Put writes it straight to a lower tier.
            return status if status == PutStatus.EXISTS else None
        try:
            assert self._arena is not None
            self._arena.write(self._check_extents(r.extents), r.payload_offset, src)
        except BaseException:
            with contextlib.suppress(KVStoreError):  # else it expires on its own
                self._call("Abort", self._stub.Abort,
                           pb.AbortRequest(reservation_id=r.reservation_id), timeout)
            raise
        c = self._call("Commit", self._stub.Commit,
                       pb.CommitRequest(reservation_id=r.reservation_id), timeout)
        return status_from_pb(c.status)

    def _put_stream(self, header: RecordHeader, src: np.ndarray, timeout: float | None
                    ) -> PutStatus:
        r = self._call("Put", self._put_raw, self._put_frames(header, src), timeout)
        return status_from_pb(r.status)

    def put_chunk(self, namespace: NamespaceLike, parent: ChunkKey, tokens: Tokens,
                  payload: Any, dtype: str, shape: Sequence[int], *,
                  timeout: float | None = None) -> tuple[ChunkKey, PutStatus]:
        """Build the record of one chunk (key from parent, namespace, tokens) and put it."""
        header = chunk_header(namespace, parent, tokens, payload, dtype, shape)
        return header.key, self.put(header, payload, timeout=timeout)

    # -- reads ------------------------------------------------------------------------------
    def acquire(self, key: bytes, *, timeout: float | None = None) -> Lease | None:
        """A read lease on a chunk in shared memory (zero copy), or None on a miss.

        Only on the server's host; raises KVStoreError when shared memory is not in use.
        """
        arena = self._shm()
        if arena is None:
            raise KVStoreError("acquire needs the shared-memory data plane (same host)")
        a = self._call("Acquire", self._stub.Acquire, pb.AcquireRequest(key=key), timeout)
        if not a.found:
            return None
        try:
            header = parse_header(a.header, expect_key=key)
            extents = self._check_extents(a.extents)
        except KVStoreError:
            self._release(a.lease_id, timeout)
            raise
        return Lease(header, a.lease_id, extents, a.payload_offset, arena,
                     lambda lid: self._release(lid, timeout))

    def _release(self, lease_id: int, timeout: float | None) -> bool:
        r = self._call("Release", self._stub.Release, pb.ReleaseRequest(lease_ids=[lease_id]),
                       timeout)
        return r.released == 1

    def _acquire_or_stream(self, key: bytes, timeout: float | None) -> Lease | str | None:
        if self._shm() is None:
            return "stream"
        t0 = time.monotonic()
        a = self._call("Acquire", self._stub.Acquire, pb.AcquireRequest(key=key), timeout)
        if not a.found:
            return "stream" if a.use_get else None
        assert self._arena is not None
        header = parse_header(a.header, expect_key=key)
        return Lease(header, a.lease_id, self._check_extents(a.extents), a.payload_offset,
                     self._arena, lambda lid: self._release(lid, timeout),
                     t0 + a.expires_ms / 1000 * LEASE_MARGIN)

    def _done_with(self, lease: Lease) -> bool:
        """Release a lease read by get/get_into; False if what was read may be wrong.

        While the lease surely still holds, the Release is sent without waiting for
        its answer: a get costs one round trip, not two.
        """
        if time.monotonic() >= lease.valid_until:
            return lease.release()
        lease.released = True
        try:
            fut = self._stub.Release.future(pb.ReleaseRequest(lease_ids=[lease.id]),
                                            timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError:
            return True  # the lease expires, or goes with the Session, on its own
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return True

    def _verified(self, header: RecordHeader, data: Any) -> None:
        if self.verify and xxhash.xxh3_64_intdigest(data) != header.payload_checksum:
            raise CorruptRecord(f"chunk {header.key.hex()[:16]}: payload read from shared "
                                "memory fails its checksum")

    def get(self, key: bytes, *, timeout: float | None = None
            ) -> tuple[RecordHeader, bytes] | None:
        """The chunk's header and raw payload, or None on a miss."""
        got = self._acquire_or_stream(key, timeout)
        if isinstance(got, Lease):
            try:
                data = got.read()
            finally:
                ok = self._done_with(got)
            if ok:
                self._verified(got.header, data)
                return got.header, data
            got = "stream"  # the lease expired while we read: the bytes may be wrong
        if got is None:
            return None
        return self._get_stream(key, None, timeout)

    def get_into(self, key: bytes, out: Any, *, timeout: float | None = None
                 ) -> RecordHeader | None:
        """Copy the chunk's raw payload into ``out`` (any writable buffer); its header or None."""
        dst = as_u8(out, writable=True)
        got = self._acquire_or_stream(key, timeout)
        if isinstance(got, Lease):
            try:
                got.read_into(dst)
            finally:
                ok = self._done_with(got)
            if ok:
                self._verified(got.header, dst[: got.header.raw_size].data)
                return got.header
            got = "stream"
        if got is None:
            return None
        found = self._get_stream(key, dst, timeout)
        return found[0] if found else None

    def _get_stream(self, key: bytes, out: np.ndarray | None, timeout: float | None
                    ) -> tuple[RecordHeader, bytes] | None:
        got = _Assembler(key, out)
        try:
            for raw in self._get_raw(pb.GetRequest(key=key), timeout=self._deadline(timeout),
                                     metadata=self._metadata):
                got.add(raw)
        except grpc.RpcError as e:
            raise self._error(e, "Get") from e
        return got.finish()

    # -- lookup and management --------------------------------------------------------------
    def lookup(self, namespace: NamespaceLike, tokens: Tokens, *, min_tokens: int = 0,
               granularity: int = 0, explain: bool = False, timeout: float | None = None
               ) -> LookupResult:
        """The longest stored prefix of ``tokens`` (partial prefix matching), one RPC."""
        req = self._lookup_request(namespace, tokens, min_tokens, granularity, explain)
        return lookup_from_pb(self._call("Lookup", self._stub.Lookup, req, timeout))

    def exists(self, keys: Sequence[bytes], *, timeout: float | None = None
               ) -> list[tuple[int, ...]]:
        """For each key, the tier levels that hold it (empty: not stored)."""
        r = self._call("Exists", self._stub.Exists, pb.ExistsRequest(keys=list(keys)), timeout)
        return [tuple(t.tiers) for t in r.found]

    def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        r = self._call("Delete", self._stub.Delete, pb.DeleteRequest(keys=list(keys)), timeout)
        return r.deleted

    def clear(self, namespace: NamespaceLike | None = None, *, all: bool = False,
              timeout: float | None = None) -> int:
        """Remove every chunk of one namespace, or everything with ``all=True``."""
        r = self._call("Clear", self._stub.Clear, self._clear_request(namespace, all), timeout)
        return r.removed

    def pin(self, keys: Sequence[bytes], pinned: bool = True, *,
            timeout: float | None = None) -> int:
        r = self._call("Pin", self._stub.Pin, pb.PinRequest(keys=list(keys), pinned=pinned),
                       timeout)
        return r.changed

    def list(self, namespace: NamespaceLike | None = None, *, tier: int = 0,
             pinned_only: bool = False, page_size: int = 500, timeout: float | None = None
             ) -> Iterator[ChunkView]:
        """Every stored chunk (of one namespace, tier), fetched page by page."""
        token = ""
        while True:
            req = self._list_request(namespace, tier, pinned_only, page_size, token)
            r = self._call("List", self._stub.List, req, timeout)
            yield from (chunk_from_pb(c) for c in r.chunks)
            token = r.next_page_token
            if not token:
                return

    def namespaces(self, *, timeout: float | None = None) -> builtins.list[NamespaceInfo]:
        return self._namespaces(self._call("Namespaces", self._stub.Namespaces,
                                           pb.NamespacesRequest(), timeout))

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """End the Session (the server drops this client's leases) and the channel."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._prefault_stop.set()
        for fut in list(self._pending):
            with contextlib.suppress(Exception):
                fut.result(timeout=1.0)
        if self._session is not None:
            self._session.join(timeout=2.0)
        self._channel.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"kvstore.Client({self.url!r})"
