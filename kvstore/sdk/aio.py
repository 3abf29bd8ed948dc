"""The asyncio SDK of kvstore-server: ``kvstore.AsyncClient``.

The same methods as ``kvstore.Client`` (see ``kvstore.sdk.client`` for URLs, the
two data planes, deadlines and errors), as coroutines over ``grpc.aio``:

    async with kvstore.AsyncClient("grpc://127.0.0.1:50551") as kv:
        key, status = await kv.put_chunk(namespace, ROOT, tokens, payload, "bfloat16", shape)
        header, data = await kv.get(key)

Each method runs the same operation of the client core as ``Client``'s
(``kvstore.sdk.client_core``, ``kvstore.sdk.client_writes``); this module is the asyncio
transport that drives it, each step awaited. What differs is only what must be
awaited: ``acquire`` gives an ``AsyncLease`` (``await lease.release()``, ``async
with``) and ``reserve`` ``AsyncReservation``s (``await res.commit()``).

Copies into and out of shared memory run on the event loop (they are memcpy
speed: ~3 ms for 32 MiB); the Session stream that keeps leases alive is a task
of the loop the client was first used on.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from kvstore.arena import ArenaView
from kvstore.errors import KVStoreError
from kvstore.keys import ChunkKey
from kvstore.records import RecordHeader
from kvstore.sdk import client_core as core
from kvstore.sdk import client_lookup as lookups
from kvstore.sdk import client_writes as writes
from kvstore.sdk.base import ClientBase
from kvstore.sdk.chunks import NamespaceLike, Tokens
from kvstore.sdk.shm import USE_GET, AsyncLease, AsyncReservation, LentLease, UseGet
from kvstore.sdk.wire import NamespaceInfo, ServerInfo
from kvstore.types import ChunkView, LookupResult, PutStatus, StoreStats
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

__all__ = ["USE_GET", "AsyncClient", "AsyncLease", "AsyncReservation", "UseGet"]

log = logging.getLogger("kvstore.sdk.client")

T = TypeVar("T")


class AsyncClient(ClientBase):
    """An asyncio client of kvstore-server. See ``kvstore.sdk.client`` for the semantics."""

    def _open(self) -> None:
        self._open_channel(grpc.aio, core.UNARY_METHODS, core.PUT)
        self._lock: asyncio.Lock | None = None
        self._pending: set[asyncio.Task[None]] = set()  # Releases sent without waiting
        self._stop: asyncio.Event | None = None

    # -- the transport: each step of a plan awaited ---------------------------------------
    async def _run(self, plan: core.Plan[T]) -> T:
        try:
            step = next(plan)
            while True:
                try:
                    result = await self._step(step)
                except BaseException as e:
                    step = plan.throw(e)
                else:
                    step = plan.send(result)
        except StopIteration as stop:
            return stop.value

    async def _step(self, step: core.Step) -> Any:
        if self._closed:
            raise KVStoreError("the client is closed")
        if type(step) is core.Call:
            try:
                return await self._methods[step.method](
                    step.request, timeout=self._deadline(step.timeout), metadata=self._metadata
                )
            except grpc.RpcError as e:
                raise self._error(e, step.method) from e
        if step is core.NEED_ARENA:
            return await self._shm()
        if type(step) is core.Send:
            if step.pipe.state is None:
                step.pipe.state = _TaskPipe()
            call = step.call
            reply = self._methods[call.method](
                call.request, timeout=self._deadline(call.timeout), metadata=self._metadata
            )
            step.pipe.state.waiting.append((call.method, asyncio.ensure_future(reply)))
            return None
        if type(step) is core.Receive:
            method, task = step.pipe.state.waiting.popleft()
            try:
                return await task
            except grpc.RpcError as e:
                raise self._error(e, method) from e
        if type(step) is core.GetStream:
            try:
                async for raw in self._get_raw(
                    step.request, timeout=self._deadline(step.timeout), metadata=self._metadata
                ):
                    step.sink.add(raw)
            except grpc.RpcError as e:
                raise self._error(e, "Get") from e
            return None
        if type(step) is core.ReleaseLater or type(step) is core.Tell:
            send = self._send_quietly(step.method, step.request())
            task = asyncio.get_running_loop().create_task(send)
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            return None
        if type(step) is core.HealthCheck:
            from grpc_health.v1 import health_pb2_grpc

            try:
                return await health_pb2_grpc.HealthStub(self._channel).Check(
                    step.request, timeout=self._deadline(step.timeout)
                )
            except grpc.RpcError:
                return None
        raise TypeError(f"not a step of the client core: {step!r}")

    async def _send_quietly(self, method: str, request: Any) -> None:
        # A Release's leases expire, or go with the Session; a Tell is told in passing.
        with contextlib.suppress(grpc.RpcError):
            await getattr(self._stub, method)(
                request, timeout=self.timeout, metadata=self._metadata
            )

    async def _shm(self) -> ArenaView | None:
        if self._plane_ready():
            return self._arena
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            arena = await self._run(core.setup_plane(self))
            if arena is not None and self._session is None and not self._session_refused:
                self._stop = asyncio.Event()
                self._session = asyncio.get_running_loop().create_task(self._run_session())
            return arena

    def _session_alive(self) -> bool:
        return self._session is not None and not self._session.done()

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

    def _plane_without_waiting(self) -> None:
        """``setup_plane`` with a blocking Info over a channel of its own: for
        ``shm_active``, which cannot await. The Session starts with the next call."""
        ep = self.endpoint
        channel = (
            grpc.secure_channel(ep.target, self._credentials(), self._options)
            if ep.tls
            else grpc.insecure_channel(ep.target, self._options)
        )
        info_rpc = pb_grpc.KVStoreStub(channel).Info

        def step(s: core.Step) -> Any:
            assert type(s) is core.Call and s.method == "Info", s  # all setup_plane asks
            try:
                return info_rpc(
                    s.request, timeout=self._deadline(s.timeout), metadata=self._metadata
                )
            except grpc.RpcError as e:
                raise self._error(e, "Info") from e

        with channel:
            core.run_blocking(core.setup_plane(self), step)

    def _lease(self, timeout: float | None) -> functools.partial[AsyncLease]:
        return functools.partial(
            AsyncLease, release=lambda lid, holder: self._run(core.release(lid, timeout, holder))
        )

    def _reservation(self, timeout: float | None) -> Callable[..., AsyncReservation]:
        def finish(rid: int, commit: bool, checksum: int | None) -> Awaitable[PutStatus]:
            return self._run(writes.finish(rid, commit, checksum, timeout))

        def make(
            h: RecordHeader,
            rid: int,
            extents: builtins.list[tuple[int, int]],
            offset: int,
            arena: ArenaView,
            until: float,
            at_commit: bool,
        ) -> AsyncReservation:
            return AsyncReservation(
                h, rid, extents, offset, arena, finish, until, at_commit, self._clock
            )

        return make

    @property
    def arena(self) -> ArenaView | None:
        """This client's mapping of the server's arena, if it has one now (no setup)."""
        return self._arena

    @property
    def shm_active(self) -> bool:
        """True when chunk bytes travel through the server's shared memory, as
        ``Client.shm_active``: set up on first use. A property cannot await: where the
        plane is not set up yet (no data-plane call so far, or the Session ended), this
        asks the server's Info with a blocking call, once."""
        if not self._plane_ready() and not (self._lock is not None and self._lock.locked()):
            self._plane_without_waiting()
        return self._arena is not None

    # -- server --------------------------------------------------------------------------
    async def info(self, *, timeout: float | None = None) -> ServerInfo:
        """What the server is and offers (versions, chunking, shared memory)."""
        return await self._run(core.info(self, timeout))

    async def health(self, *, timeout: float | None = None) -> bool:
        """True when the server answers its health check with SERVING (no token needed)."""
        return await self._run(core.health(timeout))

    async def stats(self, *, timeout: float | None = None) -> StoreStats:
        """Store and tier counters; ``extra`` holds active_leases and uptime_s."""
        return await self._run(core.stats(timeout))

    # -- writes ----------------------------------------------------------------------------
    async def put(
        self, header: RecordHeader, payload: Any, *, timeout: float | None = None
    ) -> PutStatus:
        """Store one chunk (raw payload: bytes, memoryview, numpy array...)."""
        return await self._run(writes.put(self, header, payload, timeout))

    async def put_many(
        self,
        headers: Sequence[RecordHeader],
        payloads: Sequence[Any],
        *,
        checksum_at_commit: bool = False,
        timeout: float | None = None,
    ) -> builtins.list[PutStatus]:
        """Store several chunks, each one's status: see ``Client.put_many``. This client's
        calls go by gRPC, so the batch goes in one part (one ReserveMany, one CommitMany):
        there a call costs more than pipelining parts saves."""
        return await self._run(
            writes.put_many(self, headers, payloads, checksum_at_commit, timeout)
        )

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
        return await self._run(
            writes.put_chunk(self, namespace, parent, tokens, payload, dtype, shape, timeout)
        )

    async def reserve(
        self,
        headers: Sequence[RecordHeader],
        *,
        checksum_at_commit: bool = True,
        timeout: float | None = None,
    ) -> builtins.list[AsyncReservation | PutStatus]:
        """Arena space to write chunks in place, one round trip: see ``Client.reserve``."""
        make = self._reservation(timeout)
        return await self._run(writes.reserve(self, headers, checksum_at_commit, timeout, make))

    async def commit(
        self,
        reservations: Sequence[AsyncReservation],
        checksums: Sequence[int | None] | None = None,
        *,
        timeout: float | None = None,
    ) -> builtins.list[PutStatus | KVStoreError]:
        """Commit several reservations in one round trip: see ``Client.commit``."""
        return await self._run(writes.commit(self, reservations, checksums, timeout))

    # -- reads ------------------------------------------------------------------------------
    async def acquire(self, key: bytes, *, timeout: float | None = None) -> AsyncLease | None:
        """A read lease on a chunk in shared memory (zero copy), or None on a miss; only
        on the server's host (see ``Client.acquire``)."""
        return await self._run(core.acquire(self, key, timeout, self._lease(timeout)))

    async def acquire_many(
        self,
        keys: Sequence[bytes],
        *,
        verify: bool | None = None,
        timeout: float | None = None,
        disk: bool = False,
    ) -> builtins.list[AsyncLease | UseGet | None]:
        """Leases on many chunks, one round trip per 1024 keys: for each a lease,
        ``USE_GET`` (stream it with get/get_into) or None (a miss); see
        ``Client.acquire_many``."""
        return await self._run(
            core.acquire_many(self, keys, verify, timeout, self._lease(timeout), disk)
        )

    async def release_many(
        self, leases: Sequence[AsyncLease], *, timeout: float | None = None
    ) -> int:
        """End many leases with one Release; how many the server still held (see
        ``Client.release_many``)."""
        return await self._run(core.release_many(leases, timeout))

    async def release_later(
        self, leases: Sequence[AsyncLease], *, drop: Sequence[bytes] = ()
    ) -> None:
        """``release_many`` not waiting for the answer: a task of this loop sends it
        (``drop``: chunks dropped in the same Release, see ``Client.drop``)."""
        await self._run(core.release_later(leases, drop))

    async def drop(
        self,
        keys: Sequence[bytes],
        *,
        release: Sequence[AsyncLease] = (),
        timeout: float | None = None,
    ) -> core.Dropped:
        """Drop chunks once loaded, ending ``release`` in the same Release (see
        ``Client.drop``)."""
        return await self._run(core.drop(keys, release, timeout))

    async def get(
        self, key: bytes, *, timeout: float | None = None
    ) -> tuple[RecordHeader, bytes] | None:
        """The chunk's header and raw payload, or None on a miss."""
        return await self._run(core.get(self, key, timeout))

    async def get_into(
        self, key: bytes, out: Any, *, timeout: float | None = None
    ) -> RecordHeader | None:
        """Copy the chunk's raw payload into ``out`` (any writable buffer); its header or None."""
        return await self._run(core.get_into(self, key, out, timeout))

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
        prefetch: bool = False,
        reads_disk: bool = False,
        timeout: float | None = None,
    ) -> LookupResult:
        """The longest stored prefix of ``tokens`` (partial prefix matching), one RPC.

        The prompt travels as its chunk keys and sub-hashes, hashed here as puts key
        chunks (16 KiB + 64 KiB for 128k tokens, not 512 KiB of token ids), where the
        server takes them; the server alone decides what matches, as with the ids.
        ``explain`` sends the ids (other namespaces key them otherwise).
        ``repeat``: this prompt was looked up already (by the engine's scheduler, say);
        the server answers alike but does not count the lookup again in its stats.
        ``prefetch``: the server starts promoting the matched chunks that are only below
        L1 into L1 in the background (``by_tier`` says where they are now), so that an
        ``acquire_many`` soon after finds them there; the answer does not wait for it.
        ``reads_disk`` (with ``prefetch``): the reader takes L2's records in place
        (``acquire_many(disk=True)``), so only chunks below L2 are promoted.
        """
        return await self._run(
            lookups.lookup(
                self,
                namespace,
                tokens,
                min_tokens,
                granularity,
                explain,
                repeat,
                timeout,
                prefetch,
                reads_disk,
            )
        )

    async def lookup_lend(
        self,
        namespace: NamespaceLike,
        tokens: Tokens,
        *,
        lend_from: int = 0,
        holder: str = "",
        min_tokens: int = 0,
        granularity: int = 0,
        repeat: bool = False,
        prefetch: bool = False,
        reads_disk: bool = False,
        timeout: float | None = None,
    ) -> tuple[LookupResult, builtins.list[LentLease | None]]:
        """``lookup``, lending the matched chunks from ``lend_from`` on in the same call
        (see ``Client.lookup_lend``)."""
        return await self._run(
            lookups.lookup_lend(
                self, namespace, tokens, lend_from, holder, min_tokens, granularity,
                repeat, prefetch, reads_disk, timeout,
            )
        )  # fmt: skip

    async def adopt(
        self, lent: Sequence[LentLease], *, timeout: float | None = None
    ) -> builtins.list[AsyncLease | None]:
        """Leases another client's lookup lent, read through this client's mappings (see
        ``Client.adopt``)."""
        return await self._run(lookups.adopt(self, lent, self._lease(timeout)))

    async def release_lent(self, lent: Sequence[LentLease]) -> None:
        """End leases a lookup lent that will not be read (see ``Client.release_lent``)."""
        await self._run(lookups.release_lent(lent))

    async def exists(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> builtins.list[tuple[int, ...]]:
        """For each key, the tier levels that hold it (empty: not stored)."""
        return await self._run(core.exists(keys, timeout))

    async def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove chunks from every tier; how many were stored."""
        return await self._run(core.delete(keys, timeout))

    async def clear(
        self,
        namespace: NamespaceLike | None = None,
        *,
        all: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Remove every chunk of one namespace, or everything with ``all=True``."""
        return await self._run(core.clear(self, namespace, all, timeout))

    async def pin(
        self, keys: Sequence[bytes], pinned: bool = True, *, timeout: float | None = None
    ) -> int:
        """Keep chunks from eviction (``pinned=False`` undoes it); how many changed."""
        return await self._run(core.pin(keys, pinned, timeout))

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
            chunks, token = await self._run(
                core.list_page(self, namespace, tier, pinned_only, page_size, token, timeout)
            )
            for chunk in chunks:
                yield chunk
            if not token:
                return

    async def namespaces(self, *, timeout: float | None = None) -> builtins.list[NamespaceInfo]:
        """The namespaces the server holds chunks of, with counts and bytes."""
        return await self._run(core.namespaces(self, timeout))

    # -- lifecycle ------------------------------------------------------------------------------
    async def close(self) -> None:
        """End the Session (the server drops this client's leases) and the channel."""
        if self._closed:
            return
        self._closed = True
        self._prefault_stop.set()
        if self._pending:
            await asyncio.wait(builtins.list(self._pending), timeout=1.0)
        if self._stop is not None:
            self._stop.set()
        if self._session is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._session, 2.0)
        await self._channel.close()
        for view in (self._arena, self._disk):
            if view is not None:
                view.close()
        self._arena = self._disk = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"kvstore.AsyncClient({self.url!r})"


class _TaskPipe:
    """A pipe's calls (``client_core.Pipe``) as tasks, received in the order sent."""

    def __init__(self) -> None:
        self.waiting: deque[tuple[str, asyncio.Future[Any]]] = deque()

    def end(self) -> None:
        for _, task in self.waiting:  # not received: not wanted
            task.cancel()
            task.add_done_callback(_retrieved)
        self.waiting.clear()


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A call of a pipe nobody received: its error is nobody's (asyncio would log it)."""
    if not task.cancelled():
        task.exception()
