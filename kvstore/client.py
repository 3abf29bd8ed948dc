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
``PermissionDenied``, ``InvalidArgument``, ``NotFound``, ``CorruptRecord``,
``DeadlineExceeded``, ``ResourceExhausted``, ``ServerError``. Misses are ``None``,
not exceptions.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import grpc
import numpy as np
import xxhash

from kvstore.arena import ArenaView, as_u8
from kvstore.client_writes import InPlaceWrites
from kvstore.errors import KVStoreError, NamespaceNotRegistered, NotFound
from kvstore.keys import ChunkKey, Namespace
from kvstore.protocol import (
    SERVICE_NAME,
    chunk_from_pb,
    lookup_from_pb,
    stats_from_pb,
    status_from_pb,
)
from kvstore.records import RecordHeader, parse_header
from kvstore.sdk import (
    GET_METHOD,
    LEASE_MARGIN,
    PUT_METHOD,
    ClientBase,
    Endpoint,
    GetAssembler,
    NamespaceLike,
    Tokens,
    chunk_header,
    namespace_fingerprint,
    parse_url,
)
from kvstore.shm import Lease, Reservation, prefault
from kvstore.types import ChunkView, LookupResult, PutStatus, StoreStats
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import NamespaceInfo, ServerInfo, info_from_pb

__all__ = [
    "Client",
    "Endpoint",
    "Lease",
    "Reservation",
    "chunk_header",
    "namespace_fingerprint",
    "parse_url",
    "prefault",
]

log = logging.getLogger("kvstore.client")

T = TypeVar("T")


class Client(InPlaceWrites, ClientBase):
    """A blocking client of kvstore-server; thread-safe. See the module docstring."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        tls_ca: str | bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float = 10.0,
        shm: bool | None = None,
        verify: bool = True,
    ) -> None:
        """``verify``: checksum what ``get``/``get_into`` copy out of shared memory here,
        instead of the server checking the pages before the lease. Both verify every
        byte; here the bytes are hashed as they are copied (one pass with the native
        module; cheaper than the server's pass over the pages), and a rogue writer on the
        host changing pages mid-read is caught too. ``verify=False`` leaves it to the server."""
        super().__init__(
            url,
            token=token,
            tls_ca=tls_ca,
            tls_server_name=tls_server_name,
            timeout=timeout,
            shm=shm,
            verify=verify,
        )
        ep = self.endpoint
        self._channel = (
            grpc.secure_channel(ep.target, self._credentials(), self._options)
            if ep.tls
            else grpc.insecure_channel(ep.target, self._options)
        )
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._put_raw = self._channel.stream_unary(
            PUT_METHOD, request_serializer=None, response_deserializer=pb.PutResponse.FromString
        )
        self._get_raw = self._channel.unary_stream(
            GET_METHOD,
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=None,
        )
        self._lock = threading.Lock()
        self._pending: set[grpc.Future] = set()  # Releases sent without waiting
        self._stop = threading.Event()
        self._session: threading.Thread | None = None

    # -- plumbing -------------------------------------------------------------------------
    def _call(self, what: str, method: Callable[..., T], request: Any, timeout: float | None) -> T:
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
            if self._closed:
                raise KVStoreError("the client is closed")
            if self._shm_checked and self._session is not None and not self._session.is_alive():
                # The Session ended: a restarted server has a new arena; the same one
                # (a broken stream) needs a new Session, unless the server refused it.
                info = self.info()
                if self._arena is not None and self._same_arena(info):
                    self._session = None if self._session_refused else self._start_session()
                    return self._arena
                if self._arena is not None:
                    self._arena.close()
                self._arena, self._session, self._shm_checked = None, None, False
            if not self._shm_checked:
                self._arena = self._open_arena(self.info())
                if self._arena is not None:
                    self._session = self._start_session()
                self._shm_checked = True
            return self._arena

    def _start_session(self) -> threading.Thread:
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
                self._session_ended(e)

        thread = threading.Thread(target=run, name="kvstore-session", daemon=True)
        thread.start()
        return thread

    @property
    def arena(self) -> ArenaView | None:
        """This client's mapping of the server's arena, if it has one now (no setup)."""
        return self._arena

    @property
    def shm_active(self) -> bool:
        """True when chunk bytes travel through the server's shared memory."""
        return self._shm() is not None

    # -- server --------------------------------------------------------------------------
    def info(self, *, timeout: float | None = None) -> ServerInfo:
        """What the server is and offers (versions, chunking, shared memory)."""
        self._info = info_from_pb(self._call("Info", self._stub.Info, pb.InfoRequest(), timeout))
        return self._info

    def health(self, *, timeout: float | None = None) -> bool:
        """True when the server answers its health check with SERVING (no token needed)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=self._deadline(timeout)
            )
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    def stats(self, *, timeout: float | None = None) -> StoreStats:
        """Store and tier counters; ``extra`` holds active_leases and uptime_s."""
        return stats_from_pb(self._call("Stats", self._stub.Stats, pb.StatsRequest(), timeout))

    # -- writes ----------------------------------------------------------------------------
    def put(self, header: RecordHeader, payload: Any, *, timeout: float | None = None) -> PutStatus:
        """Store one chunk (raw payload: bytes, memoryview, numpy array...)."""
        if self._info is None:
            self.info(timeout=timeout)
        return self._put(header, payload, timeout, sealed=True)

    def _put(
        self, header: RecordHeader, payload: Any, timeout: float | None, *, sealed: bool
    ) -> PutStatus:
        """``sealed=False``: the header's checksum is a placeholder; the payload is hashed
        as it is copied into the arena and the checksum goes with the Commit, and a put
        that must stream hashes the payload here first."""
        src = self._check_put(header, payload)
        arena = self._shm()
        if arena is not None:
            status = self._put_shm(header, src, timeout, sealed)
            if status is not None:
                return status
        if not sealed:
            header = replace(header, payload_checksum=xxhash.xxh3_64_intdigest(src.data))
        return self._put_stream(header, src, timeout)

    def _put_shm(
        self, header: RecordHeader, src: np.ndarray, timeout: float | None, sealed: bool
    ) -> PutStatus | None:
        (res,) = self.reserve([header], checksum_at_commit=not sealed, timeout=timeout)
        if isinstance(res, PutStatus):
            # FULL/TOO_LARGE for L1: Put writes it straight to a lower tier.
            return res if res == PutStatus.EXISTS else None
        with res:  # given back if the copy fails
            res.write(src)  # unsealed: hashed as it is copied (accel.scatter_xxh3)
            return res.commit()

    def _put_stream(
        self, header: RecordHeader, src: np.ndarray, timeout: float | None
    ) -> PutStatus:
        r = self._call("Put", self._put_raw, self._put_frames(header, src), timeout)
        return status_from_pb(r.status)

    def put_chunk(
        self,
        namespace: NamespaceLike,
        parent: ChunkKey,
        tokens: Tokens,
        payload: Any,
        dtype: str,
        shape: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> tuple[ChunkKey, PutStatus]:
        """Build the record of one chunk (key from parent, namespace, tokens) and put it.

        On a server with tenants, a namespace the server does not know as the caller's yet
        is proved with a Lookup that carries it (docs/security.md), and the put retried."""
        if self._info is None:
            self.info(timeout=timeout)
        # Through shared memory the server hashes the payload at Commit: not hashed here.
        sealed = self._shm() is None
        header = chunk_header(namespace, parent, tokens, payload if sealed else None, dtype, shape)
        try:
            return header.key, self._put(header, payload, timeout, sealed=sealed)
        except NamespaceNotRegistered:
            if not isinstance(namespace, Namespace):  # a fingerprint alone proves nothing
                raise
        self.lookup(namespace, [], timeout=timeout)
        return header.key, self._put(header, payload, timeout, sealed=sealed)

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
        return Lease(
            header,
            a.lease_id,
            extents,
            a.payload_offset,
            arena,
            lambda lid: self._release(lid, timeout),
        )

    def _release(self, lease_id: int, timeout: float | None) -> bool:
        """False if the lease was gone (expired, or dropped with a broken Session)."""
        try:
            r = self._call(
                "Release", self._stub.Release, pb.ReleaseRequest(lease_ids=[lease_id]), timeout
            )
        except NotFound:
            return False
        return r.released == 1

    def _acquire_or_stream(self, key: bytes, timeout: float | None) -> Lease | str | None:
        if self._shm() is None:
            return "stream"
        t0 = time.monotonic()
        a = self._call(
            "Acquire",
            self._stub.Acquire,
            pb.AcquireRequest(key=key, client_verifies=self.verify),
            timeout,
        )
        if not a.found:
            return "stream" if a.use_get else None
        assert self._arena is not None
        header = parse_header(a.header, expect_key=key)
        return Lease(
            header,
            a.lease_id,
            self._check_extents(a.extents),
            a.payload_offset,
            self._arena,
            lambda lid: self._release(lid, timeout),
            t0 + a.expires_ms / 1000 * LEASE_MARGIN,
        )

    def _done_with(self, lease: Lease) -> bool:
        """Release a lease read by get/get_into; False if what was read may be wrong.

        While the lease surely still holds, the Release is sent without waiting for
        its answer: a get costs one round trip, not two.
        """
        if time.monotonic() >= lease.valid_until:
            return lease.release()
        lease.released = True
        try:
            fut = self._stub.Release.future(
                pb.ReleaseRequest(lease_ids=[lease.id]),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError:
            return True  # the lease expires, or goes with the Session, on its own
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return True

    def get(self, key: bytes, *, timeout: float | None = None) -> tuple[RecordHeader, bytes] | None:
        """The chunk's header and raw payload, or None on a miss."""
        got = self._acquire_or_stream(key, timeout)
        if isinstance(got, Lease):
            try:
                data = got.read()
            finally:
                ok = self._done_with(got)
            if ok and self._verified(got.header, data):
                return got.header, data
            got = "stream"  # expired while we read, or corrupt: the server decides
        if got is None:
            return None
        return self._get_stream(key, None, timeout)

    def get_into(
        self, key: bytes, out: Any, *, timeout: float | None = None
    ) -> RecordHeader | None:
        """Copy the chunk's raw payload into ``out`` (any writable buffer); its header or None."""
        dst = as_u8(out, writable=True)
        got = self._acquire_or_stream(key, timeout)
        if isinstance(got, Lease):
            try:
                if self.verify:
                    digest = got.read_into_hashed(dst)
                else:
                    got.read_into(dst)
            finally:
                ok = self._done_with(got)
            if ok and (not self.verify or digest == got.header.payload_checksum):
                return got.header
            got = "stream"  # expired while we read, or corrupt: the server decides
        if got is None:
            return None
        found = self._get_stream(key, dst, timeout)
        return found[0] if found else None

    def _get_stream(
        self, key: bytes, out: np.ndarray | None, timeout: float | None
    ) -> tuple[RecordHeader, bytes] | None:
        got = GetAssembler(key, out)
        try:
            for raw in self._get_raw(
                pb.GetRequest(key=key), timeout=self._deadline(timeout), metadata=self._metadata
            ):
                got.add(raw)
        except grpc.RpcError as e:
            raise self._error(e, "Get") from e
        return got.finish()

    # -- lookup and management --------------------------------------------------------------
    def lookup(
        self,
        namespace: NamespaceLike,
        tokens: Tokens,
        *,
        min_tokens: int = 0,
        granularity: int = 0,
        explain: bool = False,
        repeat: bool = False,
        timeout: float | None = None,
    ) -> LookupResult:
        """The longest stored prefix of ``tokens`` (partial prefix matching), one RPC.

        ``repeat``: this prompt was looked up already (by the engine's scheduler, say);
        the server answers alike but does not count the lookup again in its stats.
        """
        req = self._lookup_request(namespace, tokens, min_tokens, granularity, explain, repeat)
        return lookup_from_pb(self._call("Lookup", self._stub.Lookup, req, timeout))

    def exists(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> list[tuple[int, ...]]:
        """For each key, the tier levels that hold it (empty: not stored)."""
        r = self._call("Exists", self._stub.Exists, pb.ExistsRequest(keys=list(keys)), timeout)
        return [tuple(t.tiers) for t in r.found]

    def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove chunks from every tier; how many were stored."""
        r = self._call("Delete", self._stub.Delete, pb.DeleteRequest(keys=list(keys)), timeout)
        return r.deleted

    def clear(
        self,
        namespace: NamespaceLike | None = None,
        *,
        all: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Remove every chunk of one namespace, or everything with ``all=True``."""
        r = self._call("Clear", self._stub.Clear, self._clear_request(namespace, all), timeout)
        return r.removed

    def pin(
        self, keys: Sequence[bytes], pinned: bool = True, *, timeout: float | None = None
    ) -> int:
        """Keep chunks from eviction (``pinned=False`` undoes it); how many changed."""
        r = self._call(
            "Pin", self._stub.Pin, pb.PinRequest(keys=list(keys), pinned=pinned), timeout
        )
        return r.changed

    def list(
        self,
        namespace: NamespaceLike | None = None,
        *,
        tier: int = 0,
        pinned_only: bool = False,
        page_size: int = 500,
        timeout: float | None = None,
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
        """The namespaces the server holds chunks of, with counts and bytes."""
        return self._namespaces(
            self._call("Namespaces", self._stub.Namespaces, pb.NamespacesRequest(), timeout)
        )

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """End the Session (the server drops this client's leases) and the channel."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._prefault_stop.set()
        deadline = time.monotonic() + 1.0  # let Releases in flight land, briefly
        for fut in list(self._pending):
            with contextlib.suppress(Exception):
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
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
