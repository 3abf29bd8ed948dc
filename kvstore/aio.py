"""The asyncio SDK of kvstore-server: ``kvstore.AsyncClient``.

The same methods as ``kvstore.Client`` (see ``kvstore.client`` for URLs, the
two data planes, deadlines and errors), as coroutines over ``grpc.aio``:

    async with kvstore.AsyncClient("grpc://127.0.0.1:50551") as kv:
        key, status = await kv.put_chunk(namespace, ROOT, tokens, payload, "bfloat16", shape)
        header, data = await kv.get(key)

Copies into and out of shared memory run on the event loop (they are memcpy
speed: ~3 ms for 32 MiB); the Session stream that keeps leases alive is a task
of the loop the client was first used on.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import numpy as np

from kvstore.arena import ArenaView, as_u8
from kvstore.errors import KVStoreError, NamespaceNotRegistered
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
    GetAssembler,
    NamespaceLike,
    Tokens,
    chunk_header,
)
from kvstore.shm import Lease
from kvstore.types import ChunkView, LookupResult, PutStatus, StoreStats
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import NamespaceInfo, ServerInfo, info_from_pb

log = logging.getLogger("kvstore.client")


class AsyncClient(ClientBase):
    """An asyncio client of kvstore-server. See ``kvstore.client`` for the semantics."""

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
            grpc.aio.secure_channel(ep.target, self._credentials(), self._options)
            if ep.tls
            else grpc.aio.insecure_channel(ep.target, self._options)
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
        self._lock: asyncio.Lock | None = None
        self._pending: set[asyncio.Task[None]] = set()  # Releases sent without waiting
        self._stop: asyncio.Event | None = None
        self._session: asyncio.Task[None] | None = None

    # -- plumbing -------------------------------------------------------------------------
    async def _call(self, what: str, method: Any, request: Any, timeout: float | None) -> Any:
        if self._closed:
            raise KVStoreError("the client is closed")
        try:
            return await method(request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, what) from e

    async def _shm(self) -> ArenaView | None:
        if self._shm_checked and (self._session is None or not self._session.done()):
            return self._arena
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._closed:
                raise KVStoreError("the client is closed")
            if self._shm_checked and self._session is not None and self._session.done():
                # The Session ended: see Client._shm.
                info = await self.info()
                if self._arena is not None and self._same_arena(info):
                    self._session = None if self._session_refused else self._new_session()
                    return self._arena
                if self._arena is not None:
                    self._arena.close()
                self._arena, self._session, self._shm_checked = None, None, False
            if not self._shm_checked:
                self._arena = self._open_arena(await self.info())
                if self._arena is not None:
                    self._stop = asyncio.Event()
                    self._session = self._new_session()
                self._shm_checked = True
            return self._arena

    def _new_session(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._run_session())

    async def _run_session(self) -> None:
        assert self._stop is not None
        stop, interval = self._stop, self._ping_interval()

        async def pings() -> AsyncIterator[pb.SessionPing]:
            yield pb.SessionPing(owner=self.session_id)
            while True:
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                    return
                except TimeoutError:
                    yield pb.SessionPing(owner=self.session_id)

        try:
            async for _ in self._stub.Session(pings(), metadata=self._metadata):
                pass
        except grpc.RpcError as e:
            if not stop.is_set():
                self._session_ended(e)

    @property
    def shm_active(self) -> bool:
        """Whether shared memory is in use (known after the first data-plane call)."""
        return self._arena is not None

    # -- server --------------------------------------------------------------------------
    async def info(self, *, timeout: float | None = None) -> ServerInfo:
        """What the server is and offers (versions, chunking, shared memory)."""
        msg = await self._call("Info", self._stub.Info, pb.InfoRequest(), timeout)
        self._info = info_from_pb(msg)
        return self._info

    async def health(self, *, timeout: float | None = None) -> bool:
        """True when the server answers its health check with SERVING (no token needed)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=self._deadline(timeout)
            )
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    async def stats(self, *, timeout: float | None = None) -> StoreStats:
        """Store and tier counters; ``extra`` holds active_leases and uptime_s."""
        return stats_from_pb(
            await self._call("Stats", self._stub.Stats, pb.StatsRequest(), timeout)
        )

    # -- writes ----------------------------------------------------------------------------
    async def put(
        self, header: RecordHeader, payload: Any, *, timeout: float | None = None
    ) -> PutStatus:
        """Store one chunk (raw payload: bytes, memoryview, numpy array...)."""
        if self._info is None:
            await self.info(timeout=timeout)
        src = self._check_put(header, payload)
        arena = await self._shm()
        if arena is not None:
            r = await self._call(
                "Reserve", self._stub.Reserve, pb.ReserveRequest(header=header.pack()), timeout
            )
            status = status_from_pb(r.status)
            if status == PutStatus.EXISTS:
                return status
            if status == PutStatus.STORED:
                try:
                    arena.write(self._check_extents(r.extents), r.payload_offset, src)
                except BaseException:
                    with contextlib.suppress(KVStoreError):
                        await self._call(
                            "Abort",
                            self._stub.Abort,
                            pb.AbortRequest(reservation_id=r.reservation_id),
                            timeout,
                        )
                    raise
                c = await self._call(
                    "Commit",
                    self._stub.Commit,
                    pb.CommitRequest(reservation_id=r.reservation_id),
                    timeout,
                )
                return status_from_pb(c.status)
        r = await self._call("Put", self._put_raw, self._put_frames(header, src), timeout)
        return status_from_pb(r.status)

    async def put_chunk(
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
        """Build the record of one chunk (key from parent, namespace, tokens) and put it
        (proving the namespace first where a server with tenants asks: see Client)."""
        header = chunk_header(namespace, parent, tokens, payload, dtype, shape)
        try:
            return header.key, await self.put(header, payload, timeout=timeout)
        except NamespaceNotRegistered:
            if not isinstance(namespace, Namespace):  # a fingerprint alone proves nothing
                raise
        await self.lookup(namespace, [], timeout=timeout)
        return header.key, await self.put(header, payload, timeout=timeout)

    # -- reads ------------------------------------------------------------------------------
    async def _lease(self, key: bytes, timeout: float | None) -> Lease | str | None:
        arena = await self._shm()
        if arena is None:
            return "stream"
        t0 = time.monotonic()
        a = await self._call(
            "Acquire",
            self._stub.Acquire,
            pb.AcquireRequest(key=key, client_verifies=self.verify),
            timeout,
        )
        if not a.found:
            return "stream" if a.use_get else None
        header = parse_header(a.header, expect_key=key)
        # The release callback is unused: AsyncClient releases with _done_with below.
        return Lease(
            header,
            a.lease_id,
            self._check_extents(a.extents),
            a.payload_offset,
            arena,
            lambda lid: True,
            t0 + a.expires_ms / 1000 * LEASE_MARGIN,
        )

    async def _done_with(self, lease: Lease, timeout: float | None) -> bool:
        """Release a lease; False if what was read may be wrong (see Client._done_with)."""
        lease.released = True
        request = pb.ReleaseRequest(lease_ids=[lease.id])
        if time.monotonic() >= lease.valid_until:
            r = await self._call("Release", self._stub.Release, request, timeout)
            return bool(r.released == 1)
        task = asyncio.get_running_loop().create_task(self._release_quietly(request))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return True

    async def _release_quietly(self, request: pb.ReleaseRequest) -> None:
        with contextlib.suppress(grpc.RpcError):
            await self._stub.Release(request, timeout=self.timeout, metadata=self._metadata)

    async def get(
        self, key: bytes, *, timeout: float | None = None
    ) -> tuple[RecordHeader, bytes] | None:
        """The chunk's header and raw payload, or None on a miss."""
        got = await self._lease(key, timeout)
        if isinstance(got, Lease):
            try:
                data = got.read()
            finally:
                ok = await self._done_with(got, timeout)
            if ok and self._verified(got.header, data):
                return got.header, data
            got = "stream"  # expired while we read, or corrupt: the server decides
        if got is None:
            return None
        return await self._get_stream(key, None, timeout)

    async def get_into(
        self, key: bytes, out: Any, *, timeout: float | None = None
    ) -> RecordHeader | None:
        """Copy the chunk's raw payload into ``out`` (any writable buffer); its header or None."""
        dst = as_u8(out, writable=True)
        got = await self._lease(key, timeout)
        if isinstance(got, Lease):
            try:
                if self.verify:
                    digest = got.read_into_hashed(dst)
                else:
                    got.read_into(dst)
            finally:
                ok = await self._done_with(got, timeout)
            if ok and (not self.verify or digest == got.header.payload_checksum):
                return got.header
            got = "stream"  # expired while we read, or corrupt: the server decides
        if got is None:
            return None
        found = await self._get_stream(key, dst, timeout)
        return found[0] if found else None

    async def _get_stream(
        self, key: bytes, out: np.ndarray | None, timeout: float | None
    ) -> tuple[RecordHeader, bytes] | None:
        got = GetAssembler(key, out)
        try:
            async for raw in self._get_raw(
                pb.GetRequest(key=key), timeout=self._deadline(timeout), metadata=self._metadata
            ):
                got.add(raw)
        except grpc.RpcError as e:
            raise self._error(e, "Get") from e
        return got.finish()

    # -- lookup and management --------------------------------------------------------------
    async def lookup(
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
        return lookup_from_pb(await self._call("Lookup", self._stub.Lookup, req, timeout))

    async def exists(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> builtins.list[tuple[int, ...]]:
        """For each key, the tier levels that hold it (empty: not stored)."""
        r = await self._call(
            "Exists", self._stub.Exists, pb.ExistsRequest(keys=list(keys)), timeout
        )
        return [tuple(t.tiers) for t in r.found]

    async def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove chunks from every tier; how many were stored."""
        r = await self._call(
            "Delete", self._stub.Delete, pb.DeleteRequest(keys=list(keys)), timeout
        )
        return int(r.deleted)

    async def clear(
        self,
        namespace: NamespaceLike | None = None,
        *,
        all: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Remove every chunk of one namespace, or everything with ``all=True``."""
        r = await self._call(
            "Clear", self._stub.Clear, self._clear_request(namespace, all), timeout
        )
        return int(r.removed)

    async def pin(
        self, keys: Sequence[bytes], pinned: bool = True, *, timeout: float | None = None
    ) -> int:
        """Keep chunks from eviction (``pinned=False`` undoes it); how many changed."""
        r = await self._call(
            "Pin", self._stub.Pin, pb.PinRequest(keys=list(keys), pinned=pinned), timeout
        )
        return int(r.changed)

    async def list(
        self,
        namespace: NamespaceLike | None = None,
        *,
        tier: int = 0,
        pinned_only: bool = False,
        page_size: int = 500,
        timeout: float | None = None,
    ) -> AsyncIterator[ChunkView]:
        """Every stored chunk (of one namespace, tier), fetched page by page."""
        token = ""
        while True:
            req = self._list_request(namespace, tier, pinned_only, page_size, token)
            r = await self._call("List", self._stub.List, req, timeout)
            for c in r.chunks:
                yield chunk_from_pb(c)
            token = r.next_page_token
            if not token:
                return

    async def namespaces(self, *, timeout: float | None = None) -> builtins.list[NamespaceInfo]:
        """The namespaces the server holds chunks of, with counts and bytes."""
        return self._namespaces(
            await self._call("Namespaces", self._stub.Namespaces, pb.NamespacesRequest(), timeout)
        )

    # -- lifecycle ------------------------------------------------------------------------------
    async def close(self) -> None:
        """End the Session (the server drops this client's leases) and the channel."""
        if self._closed:
            return
        self._closed = True
        self._prefault_stop.set()
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=1.0)
        if self._stop is not None:
            self._stop.set()
        if self._session is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._session, 2.0)
        await self._channel.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"kvstore.AsyncClient({self.url!r})"
