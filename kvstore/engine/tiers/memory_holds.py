"""L1's holds: the zero-copy data plane other processes write and read the arena by.

A mixin of ``kvstore.engine.tiers.memory.MemoryTier`` (``L1Holds``), split out as its read
path is (``memory_reads``), so that neither module grows past what one sitting reads; it
works on the tier's index, arena, holds and lock, declared below for the type checker.
``reserve`` and ``commit`` (a client writes the pages between them), ``release`` of a read
lease, renewal, expiry and what a client that went away held: the contract is the tier's
(its module docstring) and ``tiers.holds``'s table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.engine.tiers.holds import Hold, Kind
from kvstore.engine.tiers.memory_reads import Entry, L1State
from kvstore.engine.tiers.pages import LeaseError, Reservation
from kvstore.errors import CorruptRecord, InvalidArgument
from kvstore.keys import ChunkKey
from kvstore.records import RecordHeader
from kvstore.types import PutStatus


class L1Holds(L1State):
    if TYPE_CHECKING:  # the rest of the tier's state this works on (MemoryTier, L1Reads)

        def _check_raw(self, header: RecordHeader) -> None: ...
        def _allocate(
            self, header: RecordHeader, *, new_key: bool = False
        ) -> Entry | PutStatus: ...
        def _publish(self, entry: Entry) -> PutStatus: ...
        def _free_locked(self, entry: Entry) -> None: ...
        def _header_ok(self, entry: Entry) -> bool: ...
        def _payload_ok(self, entry: Entry) -> bool: ...

    # -- holds (kvstore.engine.tiers.holds) ----------------------------------------
    def _give_back_locked(self, hold: Hold[Entry]) -> None:
        """What a hold kept: a lease's reference, a reservation's pages."""
        if hold.kind == "lease":
            self._unref_locked(hold.entry)
        else:
            self._free_locked(hold.entry)

    def _end_locked(self, hid: int, kind: Kind) -> bool:
        """End the hold ``hid`` of ``kind`` and give back what it kept; False if not held."""
        hold = self._holds.pop(hid, kind)
        if hold is not None:
            self._give_back_locked(hold)
        return hold is not None

    def _expired_locked(self, hid: int) -> bool:
        hold = self._holds.pop_expired(hid)
        if hold is not None:
            self._give_back_locked(hold)
        return hold is not None

    def _sweep_locked(self) -> int:
        due = self._holds.pop_due()
        for hold in due:
            self._give_back_locked(hold)
        return len(due)

    def sweep(self) -> int:
        """Reclaim expired reservations and leases; how many. The server calls this periodically."""
        with self._lock:
            self._check_open()
            return self._sweep_locked()

    # -- zero-copy data plane ------------------------------------------------------
    def reserve(
        self,
        header: RecordHeader,
        *,
        owner: str = "",
        checksum_at_commit: bool = False,
        lasting: bool = False,
    ) -> Reservation | PutStatus:
        """Pages for a record whose payload the caller writes; EXISTS/FULL/TOO_LARGE as put.

        ``lasting``: the reservation never expires; only ``commit``/``abort`` end it
        (for a writer that lives in this process: the server's Put streams).

        ``checksum_at_commit``: ``header.payload_checksum`` is a placeholder; the writer
        hashes its bytes once they are in place (after a device-to-host copy straight
        into the arena, or piece by piece as it copies) and gives the checksum to
        ``commit``, which seals the header with it: a stray write into the pages before the
        commit fails the first read's check (the commit's own, with ``verify_reads`` off).
        """
        self._check_raw(header)
        with self._lock:
            self._check_open()
            if header.key in self._chunks:
                return PutStatus.EXISTS
        entry = self._allocate(header)
        if isinstance(entry, PutStatus):
            return entry
        self._arena.write(entry.extents, 0, entry.packed)
        with self._lock:
            rid, expires = self._holds.add(
                "reservation", entry, owner, lasting=lasting, at_commit=checksum_at_commit
            )
        return Reservation(rid, header.key, entry.extents, entry.hs, expires)

    def commit(self, reservation_id: int, checksum: int | None = None) -> PutStatus:
        """Check what the client wrote and publish it: STORED, or EXISTS if the key won a race.

        ``checksum``: the payload's xxh3_64, required for a ``checksum_at_commit``
        reservation; otherwise optional and it must equal the header's. Raises
        ``LeaseError`` for an unknown or expired reservation, ``InvalidArgument`` for a
        missing or contradicting checksum (pages freed), and ``CorruptRecord``
        (pages freed, counted) if the header was overwritten, or, with ``verify_reads``
        off, if the payload does not match its checksum (with it on, every read hashes
        the payload, so a bad one is published and found by its first reader).
        """
        with self._lock:
            self._check_open()
            if self._expired_locked(reservation_id):
                raise LeaseError(f"reservation {reservation_id} expired before commit")
            hold = self._holds.pop(reservation_id, "reservation")
            if hold is None:
                raise LeaseError(f"unknown reservation {reservation_id}")
            bad = ""
            if hold.checksum_at_commit and checksum is None:
                bad = "was made with checksum_at_commit: commit needs the payload checksum"
            elif not hold.checksum_at_commit and checksum not in (
                None,
                hold.entry.header.payload_checksum,
            ):
                bad = "the checksum at commit differs from the header's"
            if bad:  # a used reservation either way: its pages go back
                self._free_locked(hold.entry)
                raise InvalidArgument(f"reservation {reservation_id} {bad}")
        entry = hold.entry
        header_ok = self._header_ok(entry)
        if header_ok and hold.checksum_at_commit:
            assert checksum is not None
            self._seal(entry, checksum)
        if not header_ok or (not self._verify and not self._payload_ok(entry)):
            with self._lock:
                self._free_locked(entry)
                self._stats.corrupt += 1
            what = "payload checksum mismatch" if header_ok else "header overwritten"
            raise CorruptRecord(f"reservation {reservation_id}: {what}")
        return self._publish(entry)

    def _seal(self, entry: Entry, checksum: int) -> None:
        """Rewrite the header with the payload checksum the writer gave at commit (same
        size: only the checksum fields change)."""
        entry.header = entry.header.with_checksum(checksum)
        entry.packed = entry.header.pack()
        self._arena.write(entry.extents, 0, entry.packed)

    def header(self, key: ChunkKey) -> RecordHeader | None:
        """The header of a committed chunk (as sealed), or None."""
        with self._lock:
            entry = self._chunks.get(key)
            return None if entry is None else entry.header

    def abort(self, reservation_id: int) -> bool:
        """Give back a reservation's pages; False if it was not held (or already expired)."""
        with self._lock:
            self._check_open()
            return self._end_locked(reservation_id, "reservation")

    def release(self, lease_id: int) -> bool:
        """End a read lease. False if it was unknown or had expired: then the pages may
        have been reused while the holder read them, so it must discard what it read."""
        with self._lock:
            self._check_open()
            return not self._expired_locked(lease_id) and self._end_locked(lease_id, "lease")

    def renew(self, hold_id: int) -> bool:
        """Extend a lease or reservation by ``lease_ms`` from now; False if not held."""
        with self._lock:
            self._check_open()
            return not self._expired_locked(hold_id) and self._holds.renew(hold_id)

    def renew_owner(self, owner: str) -> int:
        """Renew every live lease and reservation tagged ``owner`` (a session ping); how many."""
        with self._lock:
            self._check_open()
            self._sweep_locked()  # what already expired stays expired
            return self._holds.renew_owner(owner)

    def hold_info(self, hold_id: int) -> tuple[str, str, int] | None:
        """(owner, "lease" or "reservation", payload bytes) of a hold not yet given back
        or reclaimed (one that expired a moment ago answers until the next sweep, so its
        holder learns from ``release`` that it expired); None if there is none."""
        with self._lock:
            hold = self._holds.get(hold_id)
            if hold is None:
                return None
            return hold.owner, hold.kind, hold.entry.header.stored_size

    def release_owner(self, owner: str) -> int:
        """Drop every lease and reservation tagged ``owner`` (a client went away); how many.

        Lasting holds stay: only the stream that holds one gives it back."""
        with self._lock:
            self._check_open()
            holds = self._holds.pop_owner(owner)
            for hold in holds:
                self._give_back_locked(hold)
            return len(holds)
