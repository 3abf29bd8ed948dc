"""L2's read path: reads of LMDB's records, in place or copied out, and loans of them.

A mixin of ``kvstore.engine.tiers.disk.DiskTier`` (``L2Reads``), split out as the store's
read path is (``store_reads``), so that neither module grows past what one sitting reads;
it works on the tier's index, counters, LMDB environment and loans, declared below for the
type checker. A read never takes a write transaction: its bookkeeping (LRU order, hits)
is in memory and written back in batches (the tier's docstring); a record that does not
verify is deleted (``_drop_corrupt``, the tier's) and a miss.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import lmdb

from kvstore.engine.tiers.base import ChunkInfo, T
from kvstore.engine.tiers.disk_format import DATA_FILE, Entry, copy_out, in_place, parse_meta
from kvstore.engine.tiers.disk_loans import Lent, Loans, address, map_base
from kvstore.errors import CorruptRecord, TierError
from kvstore.keys import ChunkKey
from kvstore.records import Codec, RecordHeader

_SCAN_BATCH = 512


class L2Reads:
    if TYPE_CHECKING:  # the tier's state this works on (DiskTier sets it up)
        path: str
        loans: Loans
        _lock: threading.Lock
        _index: OrderedDict[bytes, Entry]
        _dirty: set[bytes]
        _n: dict[str, int]
        _seq: int
        _env: lmdb.Environment
        _records: lmdb._Database
        _meta: lmdb._Database
        _map_base: int | None
        _map_size: int

        def _check_open(self) -> None: ...
        def _now_ms(self) -> int: ...
        def _count(self, **kw: int) -> None: ...
        def _backend_error(self, what: str, e: Exception) -> TierError: ...
        def _backend(self, what: str) -> contextlib.AbstractContextManager[None]: ...
        def _drop_corrupt(self, key: bytes, why: str) -> None: ...

    def get(self, key: ChunkKey) -> bytes | None:
        blob = self._read(bytes(key), lambda k, view: copy_out(k, view, None))
        return blob if isinstance(blob, bytes) else None

    def get_into(self, key: ChunkKey, out: memoryview) -> RecordHeader | None:
        header = self._read(bytes(key), lambda k, view: copy_out(k, view, out))
        return header if isinstance(header, RecordHeader) else None

    def read_with(self, key: ChunkKey, use: Callable[[RecordHeader, memoryview], T]) -> T | None:
        """``use(header, stored payload)`` on the record in place in LMDB's map (valid only
        during the call, not yet verified), and what it returns; None on a miss. ``use``
        raises CorruptRecord if the bytes do not verify: the record is deleted, a miss.
        For a reader that copies the payload once, verifying it as it lands (the store's
        promotion into L1), where ``get`` would copy it out first."""

        def consume(k: bytes, view: memoryview) -> T:
            header, stored = in_place(k, view)
            return use(header, stored)

        return self._read(bytes(key), consume)

    def _note_read(self, key: bytes) -> Entry | None:
        """A read's bookkeeping (LRU, hits), done before the read and counted as a hit:
        a 1 MiB copy flushes this core's L2, and what runs after it runs from L3. Should
        the read then miss (evicted meanwhile, or damaged and deleted), the counts are
        put right (``_unnote``) and the entry it touched is gone too. None: a miss."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._n["misses"] += 1
                return None
            self._index.move_to_end(key)
            self._seq += 1
            entry.seq, entry.last_ms, entry.hits = self._seq, self._now_ms(), entry.hits + 1
            self._dirty.add(key)
            self._n["hits"] += 1
            self._n["bytes_out"] += entry.size
            return entry

    def _unnote(self, entry: Entry, *, miss: bool) -> None:
        self._count(hits=-1, bytes_out=-entry.size, misses=int(miss))

    def _read(self, key: bytes, consume: Callable[[bytes, memoryview], T]) -> T | None:
        self._check_open()
        entry = self._note_read(key)
        if entry is None:
            return None
        result: T | None = None
        damaged: str | None = None
        try:
            with self._env.begin(db=self._records, buffers=True) as txn:
                view = txn.get(key)  # a view into the map, valid until the txn ends
                if view is not None:
                    try:
                        result = consume(key, view)
                    except CorruptRecord as e:
                        damaged = str(e)
        except (lmdb.CorruptedError, lmdb.PageNotFoundError) as e:
            damaged = f"LMDB cannot read it: {e}"  # its own pages are zeroed or overwritten
        except BaseException as e:
            self._unnote(entry, miss=False)
            if isinstance(e, lmdb.Error):
                raise self._backend_error("get", e) from e
            raise
        if result is None:  # evicted since the index said it was here, or damaged
            self._unnote(entry, miss=True)
            if damaged is not None:
                self._drop_corrupt(key, damaged)
            return None
        return result

    # -- loans ---------------------------------------------------------------------
    @property
    def data_file(self) -> str:
        """LMDB's data file, which a loan's offsets are in."""
        return os.path.join(self.path, DATA_FILE)

    @property
    def map_size(self) -> int:
        """LMDB's map: the most the data file can grow to (a loan's reader maps this)."""
        return self._map_size

    def lend(self, keys: Sequence[ChunkKey], owner: str = "") -> list[Lent | None]:
        """Lend these chunks' records where they lie in ``data_file`` (``disk_loans``):
        for each key a loan, or None where L2 does not hold the chunk or holds it
        encoded (a codec other than raw cannot be copied as it lies: read it). One read
        transaction keeps them all in place until the last loan ends. Counted as reads
        (hits, LRU order). Only the header is checked here: the reader verifies the
        payload against it as it copies."""
        self._check_open()
        if self._map_base is None:
            self._map_base = map_base(self.data_file)
        records: list[tuple[ChunkKey, RecordHeader, bytes, int, int] | None] = []
        damaged: list[tuple[bytes, str]] = []
        try:
            txn = self._env.begin(db=self._records, buffers=True)
        except lmdb.Error as e:
            raise self._backend_error("lend", e) from e
        try:
            for key in keys:
                k = bytes(key)
                entry = self._note_read(k)
                if entry is None:
                    records.append(None)
                    continue
                view, got, why = None, None, None
                try:
                    view = txn.get(k)
                    if view is not None:
                        header, _ = in_place(k, view)
                        if header.codec is Codec.RAW:
                            got = self._lent(key, header, view)
                except CorruptRecord as e:
                    why = str(e)
                except (lmdb.CorruptedError, lmdb.PageNotFoundError) as e:
                    why = f"LMDB cannot read it: {e}"
                if why is not None:
                    damaged.append((k, why))
                if got is None:  # an encoded record is a hit still, counted by its read
                    self._unnote(entry, miss=view is None or why is not None)
                records.append(got)
        except BaseException as e:
            txn.abort()
            if isinstance(e, lmdb.Error):
                raise self._backend_error("lend", e) from e
            raise
        lent = self.loans.lend(txn, owner, records)
        for k, why in damaged:
            self._drop_corrupt(k, why)
        return lent

    def _lent(
        self, key: ChunkKey, header: RecordHeader, view: memoryview
    ) -> tuple[ChunkKey, RecordHeader, bytes, int, int]:
        assert self._map_base is not None
        offset = address(view) - self._map_base
        if not 0 <= offset <= self._map_size - len(view):
            raise TierError(f"LMDB handed out a value outside its map ({key.hex()})")
        return key, header, bytes(view[: header.header_size]), offset, len(view)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open()
        with self._backend("contains"), self._env.begin(db=self._meta, buffers=True) as txn:
            return [txn.get(bytes(k)) is not None for k in keys]

    def scan(self, fingerprint: bytes | None = None) -> Iterator[ChunkInfo]:
        """Reads ``meta`` only, in short read transactions of a few hundred entries."""
        self._check_open()
        after: bytes | None = None
        while True:
            batch: list[tuple[bytes, bytes]] = []
            with self._backend("scan"), self._env.begin(db=self._meta, buffers=True) as txn:
                cur = txn.cursor()
                ok = cur.set_range(after + b"\0") if after is not None else cur.first()
                while ok and len(batch) < _SCAN_BATCH:
                    key = bytes(cur.key())
                    e = self._index.get(key)
                    if e is not None and (fingerprint is None or e.fingerprint == fingerprint):
                        batch.append((key, bytes(cur.value())))
                    after = key
                    ok = cur.next()
            for key, value in batch:
                try:
                    stored, header = parse_meta(key, value)
                except CorruptRecord:
                    continue  # the record itself is verified on every read
                e = self._index.get(key)
                e = e if e is not None else stored  # in memory: access info not yet written
                yield ChunkInfo(
                    key=ChunkKey(key),
                    header=header,
                    size=e.size,
                    pinned=e.pinned,
                    last_access_ms=e.last_ms,
                    hits=e.hits,
                )
            if not ok:
                return
            self._check_open()
