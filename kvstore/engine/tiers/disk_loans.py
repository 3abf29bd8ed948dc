"""L2's loans: records lent where they lie in LMDB's file, to a client on this host.

A hit in L2 read through L1 costs two passes over its bytes: the server copies the
record from LMDB's map into the arena (the promotion), then the client copies it from
the arena into its destination. On a host whose cores are busy computing, the two
cannot overlap (docs/performance.md, "The L2 load taken apart"). A loan makes it one
pass: the server opens a read transaction, which keeps the record's pages as they are
(LMDB's MVCC: a page freed by a later write is not reused while a reader that may see
it lives), and says where the record lies in ``data.mdb``; the client, which maps that
file read-only, copies the payload straight into its destination, hashing it as it
lands (the header's checksum: the server checks only the header). The server stays the
only one who opens LMDB: the client reads bytes at offsets it was lent, as it reads the
arena.

The records one call lends share one read transaction; each record is a hold of its own
(id, owner, expiry on the injected clock), ended, renewed by the owner's Session and
dropped with the owner as L1's leases are. The transaction ends with the last hold on
it. Loan ids have bit 62 set and L1's hold ids never do, so one Release takes both.

What a loan costs the writer: a page freed while a loan lives is reused only once it
ends, so the file grows by what is written meanwhile; a loan nobody ends (a client that
died mid-copy) lives until it expires (``lease_ms``).
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvstore.clock import Clock
from kvstore.errors import TierError
from kvstore.keys import ChunkKey
from kvstore.records import RecordHeader

LOAN_BIT = 1 << 62  # set in every loan id, never in an L1 hold id (those are < 2**62)


@dataclass(frozen=True)
class Lent:
    """One record lent in place: where it lies in the data file, and its header."""

    id: int  # the hold: Release it as a lease
    key: ChunkKey
    header: RecordHeader
    packed: bytes  # the header as stored (the client parses it, checking the key)
    offset: int  # of the record (header, then payload) in data.mdb
    length: int  # of the whole record
    expires: float  # on the tier's clock


class _Snapshot:
    """A read transaction shared by the holds of one call; ended with the last of them."""

    def __init__(self, txn: Any) -> None:
        self.txn = txn
        self.refs = 0


@dataclass
class _Hold:
    owner: str
    expires_at: float
    nbytes: int
    snapshot: _Snapshot


def map_base(data_file: str) -> int:
    """Where this process maps ``data_file`` from its first byte (LMDB's map of it):
    a record's offset in the file is its address less this. From /proc/self/maps,
    matched by device and inode, since LMDB does not tell (``map_addr`` is 0 unless
    the map is at a fixed address)."""
    st = os.stat(data_file)
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 5 or int(parts[2], 16) != 0 or int(parts[4]) != st.st_ino:
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            if os.makedev(major, minor) == st.st_dev:
                return int(parts[0].partition("-")[0], 16)
    raise TierError(f"{data_file} is not mapped in this process: LMDB's map not found")


def address(view: memoryview) -> int:
    """The address of the first byte of ``view`` (a value LMDB handed out in place)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class Loans:
    """The table of loans: who holds which lent record until when. Thread-safe."""

    def __init__(self, clock: Clock, lease_s: float, rng: random.Random | None = None) -> None:
        self._clock = clock
        self._lease_s = lease_s
        self._rng = rng or random.SystemRandom()
        self._lock = threading.Lock()
        self._holds: dict[int, _Hold] = {}
        self.lent = 0  # records lent since the start
        self.expired = 0  # loans reclaimed at their expiry

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def lend(
        self,
        txn: Any,
        owner: str,
        records: list[tuple[ChunkKey, RecordHeader, bytes, int, int] | None],
    ) -> list[Lent | None]:
        """Holds on ``records`` (key, header, packed header, offset, length), all seen
        through ``txn``, which ends with the last of them (at once if there is none)."""
        snap = _Snapshot(txn)
        out: list[Lent | None] = []
        with self._lock:
            expires = self._clock() + self._lease_s
            for r in records:
                if r is None:
                    out.append(None)
                    continue
                key, header, packed, offset, length = r
                hid = LOAN_BIT | self._rng.getrandbits(62)
                while hid in self._holds:
                    hid = LOAN_BIT | self._rng.getrandbits(62)
                self._holds[hid] = _Hold(owner, expires, header.stored_size, snap)
                snap.refs += 1
                out.append(Lent(hid, key, header, packed, offset, length, expires))
            self.lent += snap.refs
            if not snap.refs:
                txn.abort()
        return out

    def _drop_locked(self, hid: int) -> None:
        snap = self._holds.pop(hid).snapshot
        snap.refs -= 1
        if not snap.refs:
            snap.txn.abort()

    def release(self, hid: int) -> bool:
        """End a loan. False if unknown or expired: the pages may have been reused while
        the holder read them, so it must discard what it read."""
        with self._lock:
            hold = self._holds.get(hid)
            if hold is None:
                return False
            expired = hold.expires_at <= self._clock()
            self._drop_locked(hid)
            self.expired += expired
            return not expired

    def info(self, hid: int) -> tuple[str, str, int] | None:
        """(owner, "lease", payload bytes), as ``MemoryTier.hold_info``; None if not held."""
        with self._lock:
            hold = self._holds.get(hid)
            return None if hold is None else (hold.owner, "lease", hold.nbytes)

    def renew(self, hid: int) -> bool:
        with self._lock:
            hold = self._holds.get(hid)
            if hold is None or hold.expires_at <= self._clock():
                return False
            hold.expires_at = self._clock() + self._lease_s
            return True

    def renew_owner(self, owner: str) -> int:
        """Every live loan of ``owner`` gets a whole lease from now; how many."""
        self.sweep()
        with self._lock:
            expires = self._clock() + self._lease_s
            mine = [h for h in self._holds.values() if h.owner == owner]
            for h in mine:
                h.expires_at = expires
            return len(mine)

    def release_owner(self, owner: str) -> int:
        """End every loan of ``owner`` (it went away); how many."""
        return self._drop_where(lambda h: h.owner == owner)

    def sweep(self) -> int:
        """Reclaim the loans that expired; how many."""
        now = self._clock()
        n = self._drop_where(lambda h: h.expires_at <= now)
        with self._lock:
            self.expired += n
        return n

    def close(self) -> int:
        """End every loan (the tier is closing: no transaction may outlive the env)."""
        return self._drop_where(lambda h: True)

    def _drop_where(self, which: Callable[[_Hold], bool]) -> int:
        with self._lock:
            ids = [hid for hid, h in self._holds.items() if which(h)]
            for hid in ids:
                self._drop_locked(hid)
            return len(ids)


@runtime_checkable
class Lender(Protocol):
    """A tier that lends records where they lie in its file (``DiskTier``): how the store
    finds one, typed, without importing LMDB where no L2 is used."""

    loans: Loans

    @property
    def data_file(self) -> str: ...

    @property
    def map_size(self) -> int: ...

    def lend(self, keys: Sequence[ChunkKey], owner: str = "") -> list[Lent | None]: ...
