"""The client side of the shared-memory data plane: read leases, write reservations,
and prefaulting the arena mapping.

A lease (from ``acquire``, or inside ``get``/``get_into``) reads a chunk in the
server's arena; a reservation (from ``reserve``) is arena space a writer fills in
place and commits. Both only hold extents of a mapping the client opened.

What a lease or a reservation *is* (its extents, reading and writing them) is
``LeaseBase`` / ``ReservationBase``, shared by both clients; only ending one
differs: ``Lease.release()`` and ``Reservation.commit()`` return when done (the
blocking ``Client``), ``AsyncLease`` / ``AsyncReservation`` are awaited (the
``AsyncClient``). Each ending runs the same operation of the client core.
"""

from __future__ import annotations

import enum
import mmap
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvstore import accel
from kvstore.arena import ArenaView, as_u8, spans
from kvstore.clock import Clock, monotonic
from kvstore.errors import InvalidArgument, KVStoreError, NotFound
from kvstore.records import RecordHeader
from kvstore.types import PutStatus

__all__ = [
    "USE_GET",
    "AsyncLease",
    "AsyncReservation",
    "Lease",
    "LeaseBase",
    "Reservation",
    "ReservationBase",
    "UseGet",
    "populate",
    "prefault",
]


class UseGet(enum.Enum):
    """What ``acquire_many`` answers for a chunk that is stored but that L1 cannot lend
    now (below L1, and every page is pinned or leased): read it with ``get``/``get_into``,
    which stream it from the lower tier. ``None`` in the same list is a miss."""

    USE_GET = "use_get"

    def __repr__(self) -> str:
        return "USE_GET"


USE_GET = UseGet.USE_GET


class LentLease(NamedTuple):
    """One chunk a lookup lent, as it travels to the client that reads it (picklable)."""

    key: bytes
    lease_id: int
    header: bytes  # the record's header as stored (parsed, its key checked, on adoption)
    extents: tuple[tuple[int, int], ...]  # (offset, length) in the arena, or in L2's file
    payload_offset: int
    on_disk: bool  # lent where it lies in L2's file, not in the arena
    valid_until: float  # monotonic time before which it surely holds (the lender's clock)
    holder: str  # the session holding it: the one its Release names
    # The server's arena when it was lent (its path and inode): a lease of a server since
    # restarted names pages of another arena, and is not taken.
    arena: tuple[str, int]


class LeaseBase:
    """A read lease on a chunk in the server's arena: read in place, then release.

    The views stay valid (the pages cannot move or be reused) until the release;
    after that they may show another chunk's bytes.
    """

    def __init__(
        self,
        header: RecordHeader,
        lease_id: int,
        extents: list[tuple[int, int]],
        payload_offset: int,
        arena: ArenaView,
        valid_until: float = 0.0,
    ) -> None:
        self.header = header
        self.id = lease_id
        # Monotonic time before which the lease surely holds: measured from before the
        # Acquire was sent, with a margin, so no answer from the server is needed.
        self.valid_until = valid_until
        self._extents, self._offset, self._arena = extents, payload_offset, arena
        self.released = False
        # The session holding it when not this client's: a lease a lookup lent to another
        # session (``adopt``), ended in that session's name.
        self.holder = ""

    def views(self) -> list[memoryview]:
        """The payload as memoryviews into the arena, in order (zero copy)."""
        arr = self._arena.array
        return [
            arr[off : off + n].data
            for off, _, n in spans(self._extents, self._offset, self.header.raw_size)
        ]

    def read_into(self, out: Any) -> None:
        self._arena.read_into(self._extents, self._offset, self._destination(out))

    def read_into_hashed(self, out: Any) -> int:
        """``read_into``, returning the xxh3_64 of what was copied (to compare with
        ``header.payload_checksum``); cheaper than copying, then hashing."""
        return self._arena.read_into_hashed(self._extents, self._offset, self._destination(out))

    def read_verified(self, out: Any) -> bool:
        """Copy the payload into the first ``raw_size`` bytes of ``out`` (any writable
        C-contiguous buffer: a numpy view of a tensor's memory, say), hashing it as it is
        copied (one pass); True when what landed is the chunk (its xxh3_64 is the
        header's). False: the arena held other bytes (a rogue writer, or pages reused
        after the lease ran out); discard what was copied and read the chunk with
        ``get_into``, where the server verifies it and drops a bad copy."""
        return self.read_into_hashed(out) == self.header.payload_checksum

    def read_scattered(self, out: Any, pieces: Sequence[tuple[int, int]]) -> bool:
        """``read_verified`` into several places of one buffer, in one pass: ``pieces``
        are (offset in ``out``, length) in payload order, covering the payload exactly
        once (their lengths sum to ``raw_size``): the payload's first bytes go to the
        first piece, the next to the second, and so on. For a destination such as a
        paged KV cache, whose blocks of one chunk are not adjacent: the bytes go from
        the arena straight into the blocks, hashed as they land. True when they are
        the chunk (as ``read_verified``)."""
        dst = as_u8(out, writable=True)
        try:
            digest = accel.scatter_xxh3(self._arena.array, dst, self._trips(pieces), False)
        except ValueError as e:  # a piece outside ``out``
            raise InvalidArgument(f"read_scattered: {e}") from e
        return bool(digest == self.header.payload_checksum)

    def _trips(
        self, pieces: Sequence[tuple[int, int]], start: int = 0, whole: bool = True
    ) -> list[tuple[int, int, int]]:
        """Where ``pieces`` ((offset in a destination, length), in payload order) read the
        payload from, beginning ``start`` bytes into it: (offset in the mapping,
        destination offset, length) triples, split where the record's extents are.
        ``whole``: the pieces must cover the payload exactly (a part: they stay inside)."""
        if self.released:
            raise InvalidArgument("lease already released")
        total = sum(n for _, n in pieces)
        if any(p < 0 or n < 0 for p, n in pieces) or (
            total != self.header.raw_size - start if whole else start + total > self.header.raw_size
        ):
            raise InvalidArgument(
                f"pieces must cover the {self.header.raw_size}-byte payload exactly, "
                f"with offsets and lengths >= 0 (they hold {total} bytes from byte {start})"
            )
        trips: list[tuple[int, int, int]] = []
        pos = self._offset + start
        if len(self._extents) == 1:  # the usual case: no extent boundary to cross
            base = self._extents[0][0] + pos
            for at, n in pieces:
                trips.append((base, at, n))
                base += n
        else:
            for at, n in pieces:
                trips += [(off, at + p, m) for off, p, m in spans(self._extents, pos, n)]
                pos += n
        return trips

    def _destination(self, out: Any) -> np.ndarray:
        """The first ``raw_size`` bytes of ``out``, checked to hold the payload."""
        if self.released:
            raise InvalidArgument("lease already released")
        dst = as_u8(out, writable=True)
        if dst.size < self.header.raw_size:
            raise InvalidArgument(
                f"output buffer holds {dst.size} bytes, the payload is {self.header.raw_size}"
            )
        return dst[: self.header.raw_size]

    def read(self) -> bytes:
        if self.released:
            raise InvalidArgument("lease already released")
        return self._arena.read(self._extents, self._offset, self.header.raw_size)


class Lease(LeaseBase):
    """A lease of the blocking ``Client`` (``Client.acquire``); ``release()`` ends it."""

    def __init__(
        self,
        header: RecordHeader,
        lease_id: int,
        extents: list[tuple[int, int]],
        payload_offset: int,
        arena: ArenaView,
        release: Callable[[int, str], bool],
        valid_until: float = 0.0,
    ) -> None:
        super().__init__(header, lease_id, extents, payload_offset, arena, valid_until)
        self._release = release

    def release(self) -> bool:
        """End the lease; False if it had expired (then discard what was read)."""
        if self.released:
            return True
        self.released = True
        return self._release(self.id, self.holder)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class AsyncLease(LeaseBase):
    """A lease of ``AsyncClient.acquire``: ``await lease.release()``, or ``async with``."""

    def __init__(
        self,
        header: RecordHeader,
        lease_id: int,
        extents: list[tuple[int, int]],
        payload_offset: int,
        arena: ArenaView,
        release: Callable[[int, str], Awaitable[bool]],
        valid_until: float = 0.0,
    ) -> None:
        super().__init__(header, lease_id, extents, payload_offset, arena, valid_until)
        self._release = release

    async def release(self) -> bool:
        """End the lease; False if it had expired (then discard what was read)."""
        if self.released:
            return True
        self.released = True
        return await self._release(self.id, self.holder)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


class ReservationBase:
    """Arena space reserved for one chunk (``reserve``): write the payload in place,
    then commit, or abort.

    ``views()`` are writable arrays over the payload's bytes in the server's arena, in
    order; ``contiguous()`` is the one array when the payload is not split across
    extents (the usual case), so a device-to-host copy or a gather can land there
    directly. Nobody can read the chunk until the commit; the pages go back on
    abort, when the reservation expires (the server's ``lease_ms``), or when this
    client goes away.
    """

    def __init__(
        self,
        header: RecordHeader,
        reservation_id: int,
        extents: list[tuple[int, int]],
        payload_offset: int,
        arena: ArenaView,
        finish: Finish | AsyncFinish | None,
        valid_until: float,
        checksum_at_commit: bool,
        clock: Clock = monotonic,
    ) -> None:
        self.header = header
        self.id = reservation_id
        self._finish: Any = finish  # (id, commit?, checksum) -> status, awaitable for async
        self.valid_until = valid_until  # monotonic: surely held until then (with a margin)
        self.checksum_at_commit = checksum_at_commit
        self._clock = clock
        self._extents, self._offset, self._arena = extents, payload_offset, arena
        self._written: int | None = None  # checksum of what ``write`` put there
        self.done = False

    @property
    def nbytes(self) -> int:
        return self.header.stored_size

    @property
    def arena(self) -> ArenaView:
        """This client's mapping of the server's arena (to register it with CUDA once)."""
        return self._arena

    def _live(self) -> None:
        """Refuse to hand out or write pages the server may have given to another chunk:
        past ``valid_until`` (half the server's lease, from the reply) the reservation may
        have expired, its pages reused by a put already acknowledged. Checked before every
        write and view, so only a copy that outlasts the other half could land late."""
        if self.done:
            raise InvalidArgument(f"reservation {self.id} was already committed or aborted")
        if self._clock() >= self.valid_until:
            raise NotFound(
                f"reservation {self.id} may have expired (the server's lease_ms): "
                "abort it and reserve again"
            )

    def views(self) -> list[np.ndarray]:
        """Writable arrays over the payload's pages (see ``_live``)."""
        self._live()
        arr = self._arena.array
        return [
            arr[off : off + n]
            for off, _, n in spans(self._extents, self._offset, self.header.stored_size)
        ]

    def contiguous(self) -> np.ndarray | None:
        views = self.views()
        return views[0] if len(views) == 1 else None

    def write(self, data: Any) -> None:
        """Copy the whole payload into place (hashing it as it goes, for the commit)."""
        self._live()
        src = as_u8(data)
        if src.size != self.header.stored_size:
            raise InvalidArgument(
                f"payload is {src.size} bytes, the reservation holds {self.header.stored_size}"
            )
        if self.checksum_at_commit:
            self._written = self._arena.write_hashed(self._extents, self._offset, src)
        else:
            self._arena.write(self._extents, self._offset, src)

    def checksum(self) -> int:
        """The xxh3_64 of the payload as it is in the arena now (read in place)."""
        return self._arena.checksum(self._extents, self._offset, self.header.stored_size)

    def closing(self, checksum: int | None = None) -> int | None:
        """Mark this reservation used and return the checksum its commit carries (see
        ``Reservation.commit``); for clients committing several at once (``commit``)."""
        if self.done:
            raise InvalidArgument(f"reservation {self.id} was already committed or aborted")
        if self.checksum_at_commit and checksum is None:
            checksum = self._written if self._written is not None else self.checksum()
        self.done = True
        return checksum


Finish = Callable[[int, bool, "int | None"], PutStatus]
AsyncFinish = Callable[[int, bool, "int | None"], Awaitable[PutStatus]]


class Reservation(ReservationBase):
    """A reservation of the blocking ``Client`` (``Client.reserve``). Used as a context
    manager, a reservation not committed by the end of the block is aborted."""

    _finish: Finish

    def commit(self, checksum: int | None = None) -> PutStatus:
        """Publish the chunk: STORED, or EXISTS if another writer stored it first.

        With ``checksum_at_commit`` the payload's checksum goes with it: ``checksum`` if
        given, else the one ``write`` computed, else ``checksum()`` hashes the pages now
        (after the last write into them has finished: wait for a device copy first). The
        server seals the header with it; every read of the chunk checks the pages against
        it (a mismatch is a miss there, the chunk deleted). Raises ``CorruptRecord`` if the
        header was overwritten (or, on a server with ``verify_reads`` off, the pages do not
        match) and ``NotFound`` if the reservation expired."""
        return self._finish(self.id, True, self.closing(checksum))

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self._finish(self.id, False, None)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class AsyncReservation(ReservationBase):
    """A reservation of ``AsyncClient.reserve``: ``await res.commit()`` (as
    ``Reservation.commit``) or ``await res.abort()``; ``async with`` aborts one
    not committed by the end of the block."""

    _finish: AsyncFinish

    async def commit(self, checksum: int | None = None) -> PutStatus:
        """See ``Reservation.commit``."""
        return await self._finish(self.id, True, self.closing(checksum))

    async def abort(self) -> None:
        if not self.done:
            self.done = True
            await self._finish(self.id, False, None)

    async def __aenter__(self) -> AsyncReservation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.abort()


_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
# Bytes one madvise covers. Each call holds the process's mapping lock, and whatever maps
# memory meanwhile waits for it: a thread's start (its stack), a large allocation of the
# engine's. With 32 MiB pieces of an arena being faulted in, a client's thread starts
# took 4-18 ms, and the first load after a server restart waited for three of them
# (10-17 ms of it in the loads benchmark); with 1 MiB pieces under 1 ms.
_PIECE = 1 << 20
_BATCH = 32 << 20  # bytes advised between two looks at whether to stop


def _advise(base: int, size: int, advice: int, halt: Callable[[], bool]) -> bool:
    """madvise ``size`` bytes from ``base`` in pieces of ``_PIECE`` (``accel.advise``:
    natively without the GIL); False at the first refusal (an older kernel), or once
    ``halt()`` says to stop (looked at every ``_BATCH`` bytes)."""
    for off in range(0, size, _BATCH):
        if halt() or accel.advise(base + off, min(_BATCH, size - off), advice, _PIECE) != 0:
            return False
    return True


def _pieces(arena: ArenaView, advice: int, stop: threading.Event | None = None) -> None:
    """madvise the whole arena; stops at the first refusal, when ``stop`` is set or the
    arena closed."""
    try:
        base = arena.array.ctypes.data
    except (KVStoreError, AttributeError):  # closed already
        return
    _advise(base, arena.size, advice, lambda: (stop is not None and stop.is_set()) or arena.closed)


def page_span(address: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the whole pages that hold ``nbytes`` from ``address``: what
    madvise and mincore take (a page-aligned start)."""
    start = address & ~(mmap.PAGESIZE - 1)
    return start, nbytes + address - start


def populate(address: int, nbytes: int, stop: threading.Event | None = None) -> bool:
    """Fault in every page of ``nbytes`` of this process's memory from ``address``, for
    writing, without changing a byte (MADV_POPULATE_WRITE): memory another thread is
    using meanwhile is safe. For a buffer allocated but never touched (an engine's
    paged KV cache on CPU): the first copy into a fresh page costs a page fault and
    zeroing, ~4x the copy itself here. True once all of it is in; False where the kernel
    refused (older than 5.14) or ``stop`` was set."""
    return _advise(
        *page_span(address, nbytes),
        _MADV_POPULATE_WRITE,
        lambda: stop is not None and stop.is_set(),
    )


def retire(arena: ArenaView) -> None:
    """Unmap an arena (``ClientBase._retire_arena``), its page tables dropped piece by
    piece first (MADV_DONTNEED: a shared mapping keeps its data, a read after it faults
    the page in again). Unmapping a populated GiB in
    one call holds the process's mapping lock for ~0.25 s, and every mmap in the process
    waits meanwhile, a new thread's stack included: measured here, thread starts of up
    to 81 ms during a whole unmap, 4 ms during one by pieces."""
    _pieces(arena, _MADV_DONTNEED)
    arena.close()


def prefault(arena: ArenaView, stop: threading.Event) -> None:
    """Map every page of the arena into this process ahead of use (run on a daemon thread).

    The first write to a page of a fresh mapping costs a page fault, several
    times the copy itself; MADV_POPULATE_WRITE takes them all up front while the
    client's own work goes on. Where the kernel lacks it, pages are faulted on first use
    as before. Not at a lower CPU priority (nor is ``retire``): each call holds the
    process's mapping lock, and a holder starved of CPU by the engine's threads would
    stall every mmap in the process (tried: a load's Info call then timed out once in
    the connector suite's decode phase).
    """
    _pieces(arena, _MADV_POPULATE_WRITE, stop)
