"""The tier interface and its contract.

Every tier (L1 shared-memory arena, L2 LMDB, L3 Redis/Valkey) implements
``Tier``; ``tests/tiers/test_contract.py`` runs one suite against each. Tiers
know nothing of each other: the store composes them, moves evicted chunks down
and promotes hits up.

Contract, for every tier:

1. A tier holds chunk records (kvstore.records) by ``ChunkKey``. ``put`` is
   atomic: a reader sees the whole record or nothing, never a torn one.
2. ``put`` of a key already present returns ``EXISTS`` and leaves it alone:
   a key names one prefix, so its bytes never change.
3. ``get``/``get_into`` verify what they read. A record that fails
   verification is deleted, counted in ``stats().corrupt``, reported to
   ``on_corrupt`` (if set) and returned as a miss (``None``). Wrong bytes are
   never returned.
4. Capacity is in bytes of stored records. To make room ``put`` evicts
   least-recently-used chunks that are neither pinned nor being read, handing
   each to ``on_evict`` (if set) before it is gone, with a reader of its whole
   verified record (None if it fails verification, counted and reported as in
   3), so the store can move it down; the reader is valid only while the
   callback runs, and a tier may defer the read to it (L1 does: a chunk already
   kept below is then not read at all). If no room can be made ``put`` returns
   ``FULL``; a record larger than the whole capacity is ``TOO_LARGE``. Nothing
   committed is dropped silently.
5. Expected outcomes are return values (``None``, ``PutStatus``); a backend
   failure raises ``TierError`` (``TierUnavailable`` when a remote is down),
   chained with ``raise ... from``.
6. ``contains`` answers for many keys in one call (one round trip for a
   remote tier) and does not verify or touch LRU order.
7. ``stats`` never fails, even when the backend is down (it says so).
8. After ``close`` every method but ``stats`` raises ``StoreClosed``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Self, TypeVar

from kvstore.errors import InvalidArgument, StoreClosed
from kvstore.keys import ChunkKey
from kvstore.records import RecordHeader, decode_payload, parse_header, verify
from kvstore.types import PutStatus, TierStats

T = TypeVar("T")


@dataclass(frozen=True)
class ChunkInfo:
    """One stored chunk as a tier sees it, for inspection and index rebuilds."""

    key: ChunkKey
    header: RecordHeader
    size: int  # stored record bytes in this tier
    pinned: bool = False
    last_access_ms: int = 0
    hits: int = 0


EvictCallback = Callable[[ChunkKey, RecordHeader, Callable[[], "bytes | None"]], None]
"""Called with (key, header, read) for each chunk a tier evicts, before it is gone:
``read()`` returns the whole verified record, or None when it fails verification; only
while the callback runs (the pages are freed after it). Called only by a callback that
moves the bytes, so L1 evicts a chunk a lower tier already holds (written through)
without reading it."""


def read_already(record: bytes) -> Callable[[], bytes | None]:
    """``on_evict``'s reader for a tier that had to read (and verify) the record anyway."""
    return lambda: record


CorruptCallback = Callable[[ChunkKey], None]
"""Called with the key of each record a tier deleted because it failed verification."""


class Tier(ABC):
    """One level of storage. See the module docstring for the contract."""

    name: str = "tier"
    level: int = 0

    def __init__(self) -> None:
        self.on_evict: EvictCallback | None = None
        self.on_corrupt: CorruptCallback | None = None
        self._closed = False
        self._stats_lock = threading.Lock()

    @property
    def accepting(self) -> bool:
        """False while the tier refuses calls without trying them (an open circuit
        breaker): work for it is better kept for later than sent now."""
        return True

    # -- writes -------------------------------------------------------------
    @abstractmethod
    def put(self, header: RecordHeader, payload: bytes | memoryview) -> PutStatus:
        """Store the record ``header`` + ``payload`` (payload in ``header.codec``)."""

    def put_record(self, header: RecordHeader, record: bytes | bytearray) -> PutStatus:
        """Store a whole record as ``get`` returns it (``header``, parsed from it, packed
        in front of its stored payload): what the store's write-down holds. A tier that
        keeps records whole overrides this to store the bytes as they are, not rebuilt."""
        return self.put(header, memoryview(record)[header.header_size :])

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Remove a chunk; True if it was there. Removes pinned chunks too."""

    @abstractmethod
    def clear(self, fingerprint: bytes | None = None) -> int:
        """Remove every chunk (of one namespace fingerprint, or all); returns how many."""

    @abstractmethod
    def pin(self, key: ChunkKey, pinned: bool = True) -> bool:
        """Exempt a chunk from eviction (or undo it); False if the key is absent."""

    # -- reads --------------------------------------------------------------
    @abstractmethod
    def get(self, key: ChunkKey) -> bytes | None:
        """The whole verified record (header and stored payload), or None on a miss."""

    def get_into(self, key: ChunkKey, out: memoryview) -> RecordHeader | None:
        """Copy the decoded (raw) payload into ``out``; the header, or None on a miss.

        On a miss ``out`` may have been written (a record that fails verification is
        found out while it is copied): its contents are then undefined.
        Tiers that can read in place override this to skip the intermediate copy.
        """
        blob = self.get(key)
        if blob is None:
            return None
        header = verify(blob)
        raw = decode_payload(header, memoryview(blob)[header.header_size :])
        copy_into(out, raw, header.raw_size)
        return header

    def read_with(self, key: ChunkKey, use: Callable[[RecordHeader, memoryview], T]) -> T | None:
        """``use(header, stored payload)`` on the record, and what it returns; None on a
        miss. The payload is valid only during the call and may not be verified yet:
        ``use`` checks it as it copies it and raises CorruptRecord if it does not match.
        Tiers that can read in place override this to hand over their own bytes (the
        disk tier: a view into LMDB's map, a damaged record deleted); here it is a
        verified ``get``.
        """
        blob = self.get(key)
        if blob is None:
            return None
        header = parse_header(blob)
        return use(header, memoryview(blob)[header.header_size :])

    @abstractmethod
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key, in one call; no verification, no LRU update."""

    @abstractmethod
    def scan(self, fingerprint: bytes | None = None) -> Iterator[ChunkInfo]:
        """Every chunk held (of one namespace, or all), for inspection and rebuilds."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the counters; never raises."""

    def _report_corrupt(self, key: ChunkKey) -> None:
        """Tell the store a record was dropped as corrupt; never raises into the tier."""
        cb = self.on_corrupt
        if cb is not None:
            try:
                cb(key)
            except Exception:  # the store's bookkeeping must not break a read
                import logging

                logging.getLogger("kvstore.engine.tiers").exception("on_corrupt callback failed")

    # -- lifecycle ----------------------------------------------------------
    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"{self.name} tier is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def copy_into(out: memoryview, data: bytes | memoryview, size: int) -> None:
    if out.nbytes < size:
        raise InvalidArgument(f"output buffer holds {out.nbytes} bytes, the payload is {size}")
    flat = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    flat[:size] = data
