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

Each method is one operation of the client core (``kvstore.sdk.client_core``,
``kvstore.sdk.client_writes``), written once for this client and ``AsyncClient``;
``kvstore.sdk.blocking`` is the transport that drives them, each step a blocking call.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstore.arena import ArenaView
from kvstore.errors import KVStoreError
from kvstore.keys import ChunkKey
from kvstore.records import RecordHeader
from kvstore.sdk import client_core as core
from kvstore.sdk import client_lookup as lookups
from kvstore.sdk import client_writes as writes
from kvstore.sdk.blocking import BlockingTransport
from kvstore.sdk.chunks import NamespaceLike, Tokens, chunk_header, namespace_fingerprint
from kvstore.sdk.endpoint import Endpoint, parse_url
from kvstore.sdk.shm import USE_GET, Lease, LentLease, Reservation, UseGet, prefault
from kvstore.sdk.wire import NamespaceInfo, ServerInfo
from kvstore.types import ChunkView, LookupResult, PutStatus, StoreStats

__all__ = [
    "USE_GET",
    "Client",
    "Endpoint",
    "Lease",
    "Reservation",
    "UseGet",
    "chunk_header",
    "namespace_fingerprint",
    "parse_url",
    "prefault",
]


class Client(BlockingTransport):
    """A blocking client of kvstore-server; thread-safe. See the module docstring and
    ``ClientBase.__init__`` for its arguments (``kvstore.sdk.base``)."""

    def _lease(self, timeout: float | None) -> functools.partial[Lease]:
        return functools.partial(
            Lease, release=lambda lid, holder: self._run(core.release(lid, timeout, holder))
        )

    def _reservation(self, timeout: float | None) -> Callable[..., Reservation]:
        def finish(rid: int, commit: bool, checksum: int | None) -> PutStatus:
            return self._run(writes.finish(rid, commit, checksum, timeout))

        def make(
            h: RecordHeader,
            rid: int,
            extents: builtins.list[tuple[int, int]],
            offset: int,
            arena: ArenaView,
            until: float,
            at_commit: bool,
        ) -> Reservation:
            return Reservation(
                h, rid, extents, offset, arena, finish, until, at_commit, self._clock
            )

        return make

    @property
    def arena(self) -> ArenaView | None:
        """This client's mapping of the server's arena, if it has one now (no setup)."""
        return self._arena

    @property
    def shm_active(self) -> bool:
        """True when chunk bytes travel through the server's shared memory (set up on
        first use: the first read may wait for the server's Info)."""
        return self._shm() is not None

    # -- server --------------------------------------------------------------------------
    def info(self, *, timeout: float | None = None) -> ServerInfo:
        """What the server is and offers (versions, chunking, shared memory)."""
        return self._run(core.info(self, timeout))

    def health(self, *, timeout: float | None = None) -> bool:
        """True when the server answers its health check with SERVING (no token needed)."""
        return self._run(core.health(timeout))

    def stats(self, *, timeout: float | None = None) -> StoreStats:
        """Store and tier counters; ``extra`` holds active_leases and uptime_s."""
        return self._run(core.stats(timeout))

    # -- writes ----------------------------------------------------------------------------
    def put(self, header: RecordHeader, payload: Any, *, timeout: float | None = None) -> PutStatus:
        """Store one chunk (raw payload: bytes, memoryview, numpy array...)."""
        return self._run(writes.put(self, header, payload, timeout))

    def put_many(
        self,
        headers: Sequence[RecordHeader],
        payloads: Sequence[Any],
        *,
        checksum_at_commit: bool = False,
        timeout: float | None = None,
    ) -> builtins.list[PutStatus]:
        """Store several chunks: each one's status, as ``put`` gives it.

        On the server's host the batch goes through shared memory. Over the express
        plane (this client on the server's Unix socket) in up to four pipelined parts:
        one part's payloads are copied into their pages (hashed as they are copied)
        while the server reserves the next part and commits the one before, so the
        server's bookkeeping runs beside the copies; 2 calls a part, 8 for up to 4,096
        chunks. Over gRPC in one part (a call there costs more than the overlap saves).
        A chunk L1 cannot take now (FULL, TOO_LARGE), and every chunk elsewhere, is
        streamed with Put as ``put`` does.
        ``checksum_at_commit``: the headers' checksums are placeholders (``chunk_header``
        with ``payload=None``); the one computed as each payload is copied seals it.
        Otherwise the headers are sealed, as ``put`` takes them.
        Raises the first error a chunk's commit met (``CorruptRecord``: its header was
        overwritten) once every other chunk is stored. Any other error (``NotFound``:
        copies so slow they outlived a reservation; a broken link; the server refusing
        a part) is raised once the commits already sent are answered: those parts are
        stored, every other reservation is aborted.
        """
        return self._run(writes.put_many(self, headers, payloads, checksum_at_commit, timeout))

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
        return self._run(
            writes.put_chunk(self, namespace, parent, tokens, payload, dtype, shape, timeout)
        )

    def reserve(
        self,
        headers: Sequence[RecordHeader],
        *,
        checksum_at_commit: bool = True,
        timeout: float | None = None,
    ) -> builtins.list[Reservation | PutStatus]:
        """Arena space for chunks whose payloads the caller writes in place: one round trip.

        For each header, a ``Reservation`` (write its ``views()``, then ``commit()``), or
        the status a put would get without one: EXISTS (already stored: nothing to
        write), FULL or TOO_LARGE (L1 cannot take it now; ``put`` sends it below). With
        ``checksum_at_commit`` the headers' checksums are placeholders (``chunk_header``
        with ``payload=None``) and the checksum of what was written goes with the commit
        (``Reservation.commit``): the header is sealed with it, and every read checks the
        pages against it.
        Only on the server's host; raises KVStoreError when shared memory is not in use.
        """
        make = self._reservation(timeout)
        return self._run(writes.reserve(self, headers, checksum_at_commit, timeout, make))

    def commit(
        self,
        reservations: Sequence[Reservation],
        checksums: Sequence[int | None] | None = None,
        *,
        timeout: float | None = None,
    ) -> builtins.list[PutStatus | KVStoreError]:
        """Commit several reservations of this client in one round trip.

        ``checksums[i]`` as for ``reservations[i].commit``. For each, its status, or the
        error its own ``commit`` would have raised (that chunk is not stored; the others
        are not affected). Raises ``InvalidArgument`` before using any reservation if one
        cannot be committed (another client's, used already, twice in the list), and the
        call's error if a round trip fails: then every reservation passed in is used up
        (those of batches not sent are aborted; those sent may be stored).
        """
        return self._run(writes.commit(self, reservations, checksums, timeout))

    # -- reads ------------------------------------------------------------------------------
    def acquire(self, key: bytes, *, timeout: float | None = None) -> Lease | None:
        """A read lease on a chunk in shared memory (zero copy), or None on a miss.

        Only on the server's host; raises KVStoreError when shared memory is not in use.
        """
        return self._run(core.acquire(self, key, timeout, self._lease(timeout)))

    def acquire_many(
        self,
        keys: Sequence[bytes],
        *,
        verify: bool | None = None,
        timeout: float | None = None,
        disk: bool = False,
    ) -> builtins.list[Lease | UseGet | None]:
        """Read leases on many chunks in shared memory: one AcquireMany round trip per
        1024 keys (``MAX_RESERVE_BATCH``), however many chunks.

        For each key, in order: a ``Lease``; ``USE_GET`` when the chunk is stored but L1
        cannot lend it now (it is below L1 and every page is pinned or leased: read it
        with ``get``/``get_into``, which stream it from there); or None, a miss. Copy
        each lease's payload out verified in one pass (``Lease.read_verified`` into one
        buffer, ``Lease.read_scattered`` into the blocks of one buffer; False: read that
        chunk with ``get_into``), then end them all with ``release_many`` or, off the
        critical path, ``release_later``. ``verify`` (default: the client's ``verify``):
        True, the caller checks each payload as it copies it and the server checks only
        the headers; False, the server checks every payload before lending it.
        ``disk`` (with ``verify``): a chunk only in L2 comes as a lease on its record
        where it lies in L2's LMDB file (``Info.disk_path``, mapped read-only here), held
        in place by a read transaction of the server's until released, instead of being
        promoted into L1 first: one pass over its bytes, not two. Where the server lends
        no file, or this client cannot map it, the chunk is promoted as without it.
        Only on the server's host; raises KVStoreError when shared memory is not in use.
        """
        return self._run(core.acquire_many(self, keys, verify, timeout, self._lease(timeout), disk))

    def release_many(self, leases: Sequence[Lease], *, timeout: float | None = None) -> int:
        """End many leases with one Release; how many the server still held (fewer: some
        had expired, so bytes read through them unverified may be wrong). Leases
        released already are skipped."""
        return self._run(core.release_many(leases, timeout))

    def release_later(self, leases: Sequence[Lease], *, drop: Sequence[bytes] = ()) -> None:
        """``release_many`` without waiting for the answer (a Release sent in the
        background; ``close`` lets it land). For leases whose bytes were verified as
        they were copied, or read before their ``valid_until``. ``drop``: chunks to drop
        in the same Release, as ``drop`` does."""
        self._run(core.release_later(leases, drop))

    def drop(
        self,
        keys: Sequence[bytes],
        *,
        release: Sequence[Lease] = (),
        timeout: float | None = None,
    ) -> core.Dropped:
        """Drop chunks a consumer loaded once (the seed's drop_select), ending the
        leases ``release`` in the same call: each chunk is deleted from every tier now
        or, while another lease holds it, once the last lease on it ends (its holder
        reads it to the end). Keys not stored and other tenants' chunks are skipped."""
        return self._run(core.drop(keys, release, timeout))

    def get(self, key: bytes, *, timeout: float | None = None) -> tuple[RecordHeader, bytes] | None:
        """The chunk's header and raw payload, or None on a miss."""
        return self._run(core.get(self, key, timeout))

    def get_into(
        self, key: bytes, out: Any, *, timeout: float | None = None
    ) -> RecordHeader | None:
        """Copy the chunk's raw payload into ``out`` (any writable buffer); its header or None."""
        return self._run(core.get_into(self, key, out, timeout))

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
        return self._run(
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

    def lookup_lend(
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
        """``lookup``, lending in the same call the matched chunks from token
        ``lend_from`` on: per matched chunk a ``LentLease`` or None (not lent: before
        ``lend_from``, only below L2, or L1 could not lend it now; acquire it). Only on
        the server's host; lent are chunks in L1 and, with ``reads_disk``, in L2 where
        they lie in its file; the server reads nothing from below to answer.

        The leases are held by session ``holder`` (default: this client's); another
        client of the same server on this host takes them with ``adopt`` (they pickle),
        and they end with its ``release_many``/``release_later``, in the holder's name.
        A holder without a Session stream keeps a lease no load takes ``lease_ms`` at
        most (``kvstore.sdk.lending``)."""
        return self._run(
            lookups.lookup_lend(
                self, namespace, tokens, lend_from, holder, min_tokens, granularity,
                repeat, prefetch, reads_disk, timeout,
            )
        )  # fmt: skip

    def adopt(
        self, lent: Sequence[LentLease], *, timeout: float | None = None
    ) -> builtins.list[Lease | None]:
        """Leases another client's ``lookup_lend`` lent, read through this client's
        mappings: per lease a ``Lease`` or None (this client cannot read it: a restarted
        server, L2's file not mapped here, past its ``valid_until``; acquire that chunk
        instead, and end the lease with ``release_lent``). Copy them out
        verified (``read_verified``, ``read_scattered``) and end them with
        ``release_many`` or ``release_later`` as any other lease."""
        return self._run(lookups.adopt(self, lent, self._lease(timeout)))

    def release_lent(self, lent: Sequence[LentLease]) -> None:
        """End leases a lookup lent that will not be read (not taken with ``adopt``),
        with one Release per holder not waited for."""
        self._run(lookups.release_lent(lent))

    def exists(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> builtins.list[tuple[int, ...]]:
        """For each key, the tier levels that hold it (empty: not stored)."""
        return self._run(core.exists(keys, timeout))

    def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove chunks from every tier; how many were stored."""
        return self._run(core.delete(keys, timeout))

    def clear(
        self,
        namespace: NamespaceLike | None = None,
        *,
        all: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Remove every chunk of one namespace, or everything with ``all=True``."""
        return self._run(core.clear(self, namespace, all, timeout))

    def pin(
        self, keys: Sequence[bytes], pinned: bool = True, *, timeout: float | None = None
    ) -> int:
        """Keep chunks from eviction (``pinned=False`` undoes it); how many changed."""
        return self._run(core.pin(keys, pinned, timeout))

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
            chunks, token = self._run(
                core.list_page(self, namespace, tier, pinned_only, page_size, token, timeout)
            )
            yield from chunks
            if not token:
                return

    def namespaces(self, *, timeout: float | None = None) -> builtins.list[NamespaceInfo]:
        """The namespaces the server holds chunks of, with counts and bytes."""
        return self._run(core.namespaces(self, timeout))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"kvstore.Client({self.url!r})"
