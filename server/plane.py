"""The shared-memory data plane of the servicer: Reserve -> write -> Commit, Acquire ->
read -> Release, in batches (ReserveMany, CommitMany, AcquireMany, a Release of many,
which may also drop the chunks a consumer loaded: ``TieredStore.drop``), and the
Session stream that keeps a client's holds alive.

A mixin of ``server.service.KVStoreService`` (``SharedMemoryPlane``), split out of it;
the servicer's state and argument helpers it uses are declared below for the type
checker. Leases and reservations belong to an owner (the ``x-kvstore-session``
metadata of the call) and are checked in ``holds``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from kvstore.engine.store import Lent, ReadLease, TieredStore
from kvstore.errors import InvalidArgument, KVStoreError, NotFound
from kvstore.keys import ChunkKey
from kvstore.protocol import MAX_RESERVE_BATCH, status_of, status_to_pb
from kvstore.records import RecordHeader
from kvstore.types import LookupResult, PutStatus, TierLevel
from kvstore.v1 import kvstore_pb2 as pb

from .calls import rpc
from .config import ServerConfig
from .holds import Holds
from .streams import Watchdog, touching

log = logging.getLogger("kvstore.server")


class SharedMemoryPlane:
    if TYPE_CHECKING:  # the servicer's state and helpers (KVStoreService sets them up)
        store: TieredStore
        config: ServerConfig
        holds: Holds
        watchdog: Watchdog
        counts: Counter[tuple[str, str]]
        _lock: threading.Lock

        _info: pb.InfoResponse

        def _shm_enabled(self, context: grpc.ServicerContext) -> None: ...
        def _shm_refusal(self, context: grpc.ServicerContext) -> str | None: ...
        def _owner(self, context: grpc.ServicerContext, named: str = "") -> str: ...
        def _key(self, raw: bytes, what: str = "key") -> ChunkKey: ...
        def _keys(self, raws: Any) -> list[ChunkKey]: ...
        def _tenant(self, context: grpc.ServicerContext) -> str | None: ...
        def _visible(self, tenant: str | None, key: ChunkKey) -> bool: ...
        def _header(self, raw: bytes) -> RecordHeader: ...
        def _moved(self, direction: str, plane: str, nbytes: int) -> None: ...

    @rpc
    def Reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        self._shm_enabled(context)
        return self._reserve(request, self._owner(context))

    @rpc
    def ReserveMany(
        self, request: pb.ReserveManyRequest, context: grpc.ServicerContext
    ) -> pb.ReserveManyResponse:
        self._shm_enabled(context)
        if len(request.requests) > MAX_RESERVE_BATCH:
            raise InvalidArgument(
                f"{len(request.requests)} reservations in one ReserveMany; "
                f"at most {MAX_RESERVE_BATCH}"
            )
        owner = self._owner(context)
        out = pb.ReserveManyResponse()
        try:
            for r in request.requests:
                out.responses.append(self._reserve(r, owner))
        except BaseException:
            for done in out.responses:  # all or nothing: no pages held for an error
                if done.reservation_id:
                    with contextlib.suppress(KVStoreError):
                        self.store.abort(done.reservation_id)
            raise
        return out

    def _reserve(self, request: pb.ReserveRequest, owner: str) -> pb.ReserveResponse:
        header = self._header(request.header)
        res = self.store.reserve(header, owner=owner, checksum_at_commit=request.checksum_at_commit)
        if isinstance(res, PutStatus):
            return pb.ReserveResponse(status=status_to_pb(res))
        return pb.ReserveResponse(
            status=pb.STORED,
            reservation_id=res.id,
            extents=[pb.Extent(offset=o, length=n) for o, n in res.extents],
            payload_offset=res.payload_offset,
            expires_ms=self.store.config.memory.lease_ms,
        )

    @rpc
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        return self._commit(request, self._owner(context))

    @rpc
    def CommitMany(
        self, request: pb.CommitManyRequest, context: grpc.ServicerContext
    ) -> pb.CommitManyResponse:
        if len(request.commits) > MAX_RESERVE_BATCH:
            raise InvalidArgument(
                f"{len(request.commits)} commits in one CommitMany; at most {MAX_RESERVE_BATCH}"
            )
        owner = self._owner(context)
        out = pb.CommitManyResponse()
        for c in request.commits:
            try:
                out.responses.append(self._commit(c, owner))
            except Exception as e:  # each commit stands alone
                code, msg = status_of(e)
                if not isinstance(e, KVStoreError):
                    log.exception("CommitMany: reservation %d failed", c.reservation_id)
                with self._lock:
                    self.counts[("Commit", code.name)] += 1  # as a single Commit would count
                out.responses.append(pb.CommitResponse(error_code=code.value[0], error=msg))
        return out

    def _commit(self, request: pb.CommitRequest, owner: str) -> pb.CommitResponse:
        nbytes = self.holds.claim(request.reservation_id, owner, "reservation")
        checksum = request.payload_checksum if request.HasField("payload_checksum") else None
        status = self.store.commit(request.reservation_id, checksum)
        if status == PutStatus.STORED:
            self._moved("in", "shm", nbytes)
        return pb.CommitResponse(status=status_to_pb(status))

    @rpc
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        self.holds.claim(request.reservation_id, self._owner(context), "reservation")
        self.store.abort(request.reservation_id)
        return pb.AbortResponse()

    @rpc
    def Acquire(
        self, request: pb.AcquireRequest, context: grpc.ServicerContext
    ) -> pb.AcquireResponse:
        self._shm_enabled(context)
        key = self._key(request.key)
        return self._acquire(key, self._owner(context), request.client_verifies)

    @rpc
    def AcquireMany(
        self, request: pb.AcquireManyRequest, context: grpc.ServicerContext
    ) -> pb.AcquireManyResponse:
        self._shm_enabled(context)
        if len(request.keys) > MAX_RESERVE_BATCH:
            raise InvalidArgument(
                f"{len(request.keys)} keys in one AcquireMany; at most {MAX_RESERVE_BATCH}"
            )
        keys, owner = self._keys(request.keys), self._owner(context)
        if request.client_reads_disk and request.client_verifies:
            return self._lend(keys, owner)
        out = pb.AcquireManyResponse()
        try:
            for key in keys:
                out.responses.append(self._acquire(key, owner, request.client_verifies))
        except BaseException:
            # All or nothing, as ReserveMany: a failed call leaves no pages leased.
            for done in out.responses:
                if done.found:
                    self.store.release(done.lease_id)
            raise
        return out

    def lend_into(
        self,
        msg: pb.LookupResponse,
        request: pb.LookupRequest,
        result: LookupResult,
        context: grpc.ServicerContext,
    ) -> None:
        """A Lookup's answer with ``lend_from``: its leases, and the arena they are in."""
        msg.lent.extend(self._lend_matched(request, result, context))
        if msg.lent:
            msg.lent_arena, msg.lent_arena_inode = self._info.shm_path, self._info.shm_inode

    def _lend_matched(
        self, request: pb.LookupRequest, result: LookupResult, context: grpc.ServicerContext
    ) -> list[pb.AcquireResponse]:
        """``LookupRequest.lend_from``: leases on the matched chunks from that token on,
        one answer per matched chunk (found=False: not lent). Only what can be lent
        without a read: chunks in L1, and in L2 where the client reads its file. None
        where the plane is not offered to this caller: the lookup answers all the same."""
        if self._shm_refusal(context) is not None:
            return []
        reads_disk = request.client_reads_disk
        tiers = (TierLevel.MEMORY, TierLevel.DISK) if reads_disk else (TierLevel.MEMORY,)
        todo = [
            i
            for i, m in enumerate(result.chunks)
            if m.start + m.tokens > request.lend_from and m.tier in tiers
        ][:MAX_RESERVE_BATCH]
        if not todo:
            return []
        owner = self._owner(context, request.lend_to)
        keys = [result.chunks[i].key for i in todo]
        got = self._lend(keys, owner, promote=False, disk=reads_disk)
        if not context.is_active():  # the caller gave up on the answer (its deadline)
            for answer in got.responses:
                if answer.found:
                    self.store.release(answer.lease_id)
            return []
        out = [pb.AcquireResponse() for _ in result.chunks]
        for i, answer in zip(todo, got.responses, strict=True):
            out[i] = answer
        return out

    def _lend(
        self, keys: list[ChunkKey], owner: str, *, promote: bool = True, disk: bool = True
    ) -> pb.AcquireManyResponse:
        """AcquireMany for a client that reads L2's file itself: what only L2 holds is
        lent where it lies there (``on_disk``), not promoted (``TieredStore.lend``;
        ``promote=False``: nor what lies below L2, which is then not lent; ``disk=False``:
        L1's chunks only)."""
        got = self.store.lend(keys, owner, promote=promote, disk=disk)
        out = pb.AcquireManyResponse()
        lease_ms = self.store.config.memory.lease_ms
        for key, g in zip(keys, got, strict=True):
            if g is None:
                use_get = promote and key in self.store
                out.responses.append(pb.AcquireResponse(found=False, use_get=use_get))
                continue
            self._moved("out", "disk" if isinstance(g, Lent) else "shm", g.header.stored_size)
            if isinstance(g, Lent):
                out.responses.append(
                    pb.AcquireResponse(
                        found=True, on_disk=True, lease_id=g.id, header=g.packed,
                        extents=[pb.Extent(offset=g.offset, length=g.length)],
                        payload_offset=g.header.header_size, expires_ms=lease_ms,
                    )
                )  # fmt: skip
            else:
                out.responses.append(self._granted(g))
        return out

    def _acquire(self, key: ChunkKey, owner: str, client_verifies: bool) -> pb.AcquireResponse:
        lease = self.store.acquire(key, owner=owner, payload=not client_verifies)
        if lease is None:
            # Stored below but L1 could not take it now: the client falls back to Get.
            return pb.AcquireResponse(found=False, use_get=key in self.store)
        self._moved("out", "shm", lease.header.stored_size)
        return self._granted(lease)

    def _granted(self, lease: ReadLease) -> pb.AcquireResponse:
        return pb.AcquireResponse(
            found=True,
            lease_id=lease.id,
            header=lease.packed,
            extents=[pb.Extent(offset=o, length=n) for o, n in lease.extents],
            payload_offset=lease.payload_offset,
            expires_ms=self.store.config.memory.lease_ms,
        )

    @rpc
    def Release(
        self, request: pb.ReleaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseResponse:
        owner = self._owner(context, request.holder)
        ids = list(dict.fromkeys(request.lease_ids))
        drops = self._drop_keys(request, context)  # checked before anything is released
        mine = [i for i in ids if self._holds_lease(i, owner)]
        if ids and not mine and not request.drop_keys:
            self.holds.claim_leases(ids, owner)  # raises NotFound naming them
        # A batch (release_many) releases what is still the caller's; the ones that are
        # not (expired, another session's) are left out of ``released``, as is a lease
        # the tier found expired: what the client read through it may be garbage.
        # Leases that ran out do not stop the drops: the chunks were loaded either way.
        released = sum(self.store.release(i) for i in mine)
        dropped, deferred = self.store.drop(drops) if drops else (0, 0)
        return pb.ReleaseResponse(released=released, dropped=dropped, drop_deferred=deferred)

    def _drop_keys(
        self, request: pb.ReleaseRequest, context: grpc.ServicerContext
    ) -> list[ChunkKey]:
        """The chunks a Release drops: those the caller may see, as Delete's (a tenant's
        own namespaces; another tenant's chunk is a miss, never deleted)."""
        if len(request.drop_keys) > MAX_RESERVE_BATCH:
            raise InvalidArgument(
                f"{len(request.drop_keys)} drop_keys in one Release; at most {MAX_RESERVE_BATCH}"
            )
        tenant = self._tenant(context)
        keys = self._keys(request.drop_keys)
        return [k for k in keys if self._visible(tenant, k)]

    def _holds_lease(self, lease_id: int, owner: str) -> bool:
        try:
            self.holds.claim(lease_id, owner, "lease")
        except NotFound:
            return False
        return True

    @rpc
    def Session(
        self, request_iterator: Iterator[pb.SessionPing], context: grpc.ServicerContext
    ) -> Iterator[pb.SessionPong]:
        # Pings come every lease/3.
        cid, watch = self.watchdog.watch(context, "session", self._tenant(context))
        try:
            pings = touching(request_iterator, watch.touch)
            first = next(pings, None)
            if first is None:
                return
            owner = self._owner(context, first.owner)
            if not owner:
                raise InvalidArgument("the first SessionPing must name the owner (session id)")
            self.holds.open_session(owner, self.config.max_session_streams_per_owner)
            try:
                self.holds.renew(owner)
                yield pb.SessionPong(server_time_ms=int(time.time() * 1000))
                for _ in pings:
                    self.holds.renew(owner)
                    yield pb.SessionPong(server_time_ms=int(time.time() * 1000))
            finally:
                self.holds.end_session(owner)
        finally:
            self.watchdog.done(cid)
