"""L2: chunk records in LMDB on local disk.

Layout: one LMDB environment with two sub-databases keyed by the 32-byte chunk key.
``records`` holds the whole record (packed header + stored payload, in
``config.codec``); ``meta`` holds a small index entry (see ``_META``) so a restart
rebuilds the index from ``meta`` alone, without touching the records. A put
writes both in one transaction, so a chunk is either wholly there or absent.

Durability: "process" opens LMDB with sync=False (a returned put is in the page
cache and survives kill -9 of this process, not a power loss); "fsync" syncs every
commit. Writes go through write(2), never a writable map (writemap=False): a full
disk then fails the transaction cleanly instead of raising SIGBUS, and a stray
pointer in this process cannot scribble over committed pages.

Access times and hit counts live in memory and are written back in batches (with
every put, on ``flush()`` and at ``close()``), so a read never needs a write
transaction; a reader-only service should call ``flush()`` now and then. After a
crash the accesses since the last batch are forgotten, so the LRU order is
approximate, but nothing committed is lost. Across a clean close the order is exact:
it is rebuilt from a persisted access sequence number (``last_access_ms`` is for
display and follows the injected clock).

Capacity counts stored record bytes. LMDB's map is sized at 2 x capacity + 64 MiB
for page rounding, B-tree and free pages not yet reusable; if it still fills up
(MapFullError) a put evicts more LRU chunks and retries, and returns FULL only when
nothing unpinned is left.

Full disk: a write that fails with ENOSPC, EFBIG or EDQUOT (or EIO, which is how
LMDB reports a short write, while the filesystem has less than the record plus
64 MiB free) makes room by evicting a few more LRU chunks (LMDB reuses their pages)
and then returns ``PutStatus.FULL`` (counted in ``errors`` and ``rejected``;
``healthy`` is false until a write succeeds). Any other LMDB failure raises
``TierError``. Either way the failed transaction is aborted and what was committed
stays intact.

Locks: ``_wlock`` serializes writers (put, delete, clear, pin, flush) and is held
while ``on_evict`` runs; ``_lock`` guards the in-memory index and counters and is
never held across a callback, so readers never wait on one. Advisory flocks on the
directory and on ``kvstore.lock`` in it keep a second process from opening it
(``disk_format.lock_directory``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import lmdb

from kvstore.clock import Clock, monotonic, wall_ms
from kvstore.config import DiskConfig, MiB
from kvstore.engine.tiers.base import ChunkInfo, T, Tier, read_already
from kvstore.engine.tiers.disk_format import (
    DATA_FILE,
    META_FIXED,
    Entry,
    copy_out,
    in_place,
    is_disk_full,
    lock_directory,
    open_env,
    pack_meta,
    parse_meta,
    read_index,
)
from kvstore.engine.tiers.disk_loans import Lent, Loans, address, map_base
from kvstore.errors import CorruptRecord, InvalidArgument, TierError
from kvstore.keys import ChunkKey
from kvstore.records import (
    FIXED_BYTES,
    Codec,
    RecordHeader,
    transcode_parts,
    verify,
)
from kvstore.types import PutStatus, TierLevel, TierStats

log = logging.getLogger(__name__)

_DISK_FULL_ROUNDS = 4
_SCAN_BATCH = 512


class DiskTier(Tier):
    """L2: LMDB on local disk. See the module docstring for layout and guarantees."""

    name = TierLevel.DISK.label
    level = TierLevel.DISK

    def __init__(
        self,
        config: DiskConfig,
        data_dir: str,
        *,
        clock: Clock = monotonic,
        map_size: int | None = None,
        lease_s: float = 30.0,
    ) -> None:
        """``map_size`` overrides LMDB's map size (tests use it to provoke MapFullError);
        ``lease_s``: how long a loan (``lend``) lives unless renewed."""
        super().__init__()
        self.config = config
        self.path = config.resolved_path(data_dir)
        self._codec = Codec.parse(config.codec)
        self._clock = clock
        # Wall-clock milliseconds that still move with the injected clock.
        self._ms_offset = wall_ms() - int(clock() * 1000)
        # LMDB needs slack beyond the record bytes: page rounding of every value, the
        # meta entries, the B-tree and pages freed but not yet reusable.
        self._map_size = map_size or 2 * config.capacity_bytes + 64 * MiB
        self._wlock = threading.RLock()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self._dirty: set[bytes] = set()  # entries whose access info is not yet written back
        self._used = 0
        self._seq = 0
        self._n = dict.fromkeys(
            (
                "hits",
                "misses",
                "puts",
                "evictions",
                "corrupt",
                "errors",
                "rejected",
                "bytes_in",
                "bytes_out",
            ),
            0,
        )
        self._healthy = True
        self._last_error = ""
        self.loans = Loans(clock, lease_s)
        self._map_base: int | None = None  # where LMDB maps data.mdb here (loans' offsets)
        self._lock_fds = lock_directory(self.path)
        try:
            self._env = self._open_env()
            self._load_index()
        except BaseException:
            env = getattr(self, "_env", None)
            if env is not None:
                env.close()
            self._unlock()
            raise

    # -- opening --------------------------------------------------------------
    def _open_env(self) -> lmdb.Environment:
        env, self._records, self._meta = open_env(
            self.path, self._map_size, self.config.durability == "fsync"
        )
        return env

    def _load_index(self) -> None:
        """Rebuild the LRU index from ``meta`` only; drop entries that do not verify."""
        entries, broken = read_index(self._env, self._records, self._meta, self.path)
        self._index = OrderedDict(entries)
        self._used = sum(e.size for _, e in entries)
        self._seq = entries[-1][1].seq if entries else 0
        now = self._now_ms()
        if entries and entries[-1][1].last_ms > now:  # wall clock went back: keep order
            self._ms_offset += entries[-1][1].last_ms - now
        if broken:
            self._n["corrupt"] += len(broken)
            with self._backend("drop damaged entries"):
                self._write(deletes=broken)

    # -- helpers --------------------------------------------------------------
    def _now_ms(self) -> int:
        return int(self._clock() * 1000) + self._ms_offset

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._n[k] += v

    def _backend_error(self, what: str, e: Exception) -> TierError:
        with self._lock:
            self._n["errors"] += 1
            self._healthy, self._last_error = False, f"{what}: {e}"
        return TierError(f"disk tier {self.path}: {what} failed: {e}")

    @contextlib.contextmanager
    def _backend(self, what: str) -> Iterator[None]:
        """LMDB errors out of the block become a counted TierError."""
        try:
            yield
        except lmdb.Error as e:
            raise self._backend_error(what, e) from e

    def _write(
        self,
        *,
        deletes: Sequence[bytes] = (),
        put: tuple[bytes, bytes | bytearray, bytes] | None = None,
        metas: dict[bytes, Entry] | None = None,
    ) -> list[bool]:
        """One write transaction: delete keys, put one (key, record, meta), rewrite the
        trailer of the meta entries in ``metas``. Returns which deletes existed."""
        existed = []
        with self._env.begin(write=True) as txn:
            for key in deletes:
                txn.delete(key, db=self._records)
                existed.append(txn.delete(key, db=self._meta))
            if put is not None:
                txn.put(put[0], put[1], db=self._records)
                txn.put(put[0], put[2], db=self._meta)
            for key, entry in (metas or {}).items():
                old = txn.get(key, db=self._meta)
                if old is not None:
                    txn.put(key, pack_meta(entry, memoryview(old)[META_FIXED:]), db=self._meta)
        return existed

    def _take_dirty(self) -> dict[bytes, Entry]:
        with self._lock:
            out = {k: replace(e) for k in self._dirty if (e := self._index.get(k)) is not None}
            self._dirty.clear()
            return out

    def _restore_dirty(self, metas: dict[bytes, Entry]) -> None:
        with self._lock:
            self._dirty.update(k for k in metas if k in self._index)

    # -- writes ---------------------------------------------------------------
    def put(self, header: RecordHeader, payload: bytes | memoryview) -> PutStatus:
        self._check_open()
        if memoryview(payload).nbytes != header.stored_size:
            raise InvalidArgument(
                f"payload is {memoryview(payload).nbytes} bytes, its header "
                f"says {header.stored_size}"
            )
        key = bytes(header.key)
        if key in self._index:
            return PutStatus.EXISTS
        blob = self._encode(header, payload)  # outside the locks: zstd takes milliseconds
        size = len(blob)
        if size > self.config.capacity_bytes:
            self._count(rejected=1)
            return PutStatus.TOO_LARGE
        with self._wlock:
            self._check_open()
            if key in self._index:
                return PutStatus.EXISTS
            return self._put_locked(key, header.fingerprint, header.n_tokens, blob)

    def _encode(self, header: RecordHeader, payload: bytes | memoryview) -> bytes | bytearray:
        if header.codec != self._codec:
            return transcode_parts(header, payload, self._codec, self.config.level)
        blob = bytearray(header.record_size)  # one copy; LMDB needs one contiguous value
        blob[: header.header_size] = header.pack()
        blob[header.header_size :] = payload
        return blob

    def _put_locked(
        self, key: bytes, fingerprint: bytes, n_tokens: int, blob: bytes | bytearray
    ) -> PutStatus:
        size = len(blob)
        header_bytes = memoryview(blob)[: FIXED_BYTES + 4 * n_tokens]  # without the padding
        victims = self._pick_victims(self._used + size - self.config.capacity_bytes, set())
        if victims is None:
            self._count(rejected=1)
            return PutStatus.FULL
        self._hand_over(victims)
        entry = Entry(size, bytes(fingerprint), False, self._now_ms(), 0, 0)
        rounds = 0
        while True:
            metas = self._take_dirty()
            with self._lock:
                self._seq += 1
                entry.seq = self._seq
            try:
                self._write(
                    deletes=victims, put=(key, blob, pack_meta(entry, header_bytes)), metas=metas
                )
                break
            except (lmdb.Error, OSError) as e:
                self._restore_dirty(metas)
                map_full = isinstance(e, lmdb.MapFullError)
                disk_full = not map_full and is_disk_full(e, self.path, size)
                if disk_full:
                    rounds += 1
                    with self._lock:
                        self._n["errors"] += 1
                        self._healthy, self._last_error = False, f"disk full: {e}"
                # Page rounding, fragmentation, free pages not yet reusable or a full
                # filesystem: evict more, as LMDB reuses freed pages before it grows the
                # file. The deletes commit on their own: pages freed inside the failed
                # transaction could not have been reused by it. A full filesystem may be
                # someone else's doing, so it only costs a few rounds of evictions.
                more: list[bytes] = []
                if map_full or (disk_full and rounds <= _DISK_FULL_ROUNDS):
                    more = self._pick_victims(size, set(victims), partial=True) or []
                    self._hand_over(more)
                try:
                    self._commit_evictions(victims + more)  # handed over: they must go
                except TierError:
                    more = []  # they stay here as well as below: nothing is lost
                victims = []
                if not (map_full or disk_full):
                    raise self._backend_error("put", e) from e
                if not more:
                    self._count(rejected=1)
                    return PutStatus.FULL
        with self._lock:
            self._drop_from_index(victims, evicted=True)
            self._index[key] = entry
            self._used += size
            self._n["puts"] += 1
            self._n["bytes_in"] += size
            self._healthy = True
        return PutStatus.STORED

    def _pick_victims(
        self, need: int, exclude: set[bytes], partial: bool = False
    ) -> list[bytes] | None:
        """LRU unpinned keys freeing at least ``need`` bytes; None if impossible
        (or, with ``partial``, every evictable key)."""
        if need <= 0:
            return []
        out, freed = [], 0
        with self._lock:
            for key, e in self._index.items():
                if e.pinned or key in exclude:
                    continue
                out.append(key)
                freed += e.size
                if freed >= need:
                    return out
        return out if partial else None

    def _hand_over(self, victims: list[bytes]) -> None:
        """Give each victim's verified record to on_evict before it is deleted."""
        cb = self.on_evict
        if cb is None or not victims:
            return
        blobs: list[tuple[bytes, RecordHeader, bytes]] = []
        damaged: list[bytes] = []
        with (
            self._backend("read for eviction"),
            self._env.begin(db=self._records, buffers=True) as txn,
        ):
            for key in victims:
                view = txn.get(key)
                try:
                    if view is None:
                        raise CorruptRecord("record missing")
                    blobs.append((key, verify(view, expect_key=key), bytes(view)))
                except CorruptRecord as e:  # never hand wrong bytes down
                    log.warning("disk tier: evicting damaged %s: %s", key.hex(), e)
                    damaged.append(key)
        self._count(corrupt=len(damaged))
        for key in damaged:
            self._report_corrupt(ChunkKey(key))
        for key, header, blob in blobs:  # read already: the header comes from verifying it
            cb(ChunkKey(key), header, read_already(blob))

    def _commit_evictions(self, victims: list[bytes]) -> None:
        if not victims:
            return
        with self._backend("evict"):
            self._write(deletes=victims)
        with self._lock:
            self._drop_from_index(victims, evicted=True)

    def _drop_from_index(self, keys: Sequence[bytes], *, evicted: bool = False) -> int:
        """Caller holds _lock."""
        n = 0
        for key in keys:
            e = self._index.pop(key, None)
            self._dirty.discard(key)
            if e is not None:
                self._used -= e.size
                n += 1
        if evicted:
            self._n["evictions"] += n
        return n

    def delete(self, key: ChunkKey) -> bool:
        self._check_open()
        with self._wlock:
            self._check_open()
            with self._backend("delete"):
                (existed,) = self._write(deletes=[bytes(key)])
            with self._lock:
                self._drop_from_index([bytes(key)])
            return existed

    def clear(self, fingerprint: bytes | None = None) -> int:
        self._check_open()
        with self._wlock:
            self._check_open()
            with self._lock:
                keys = [
                    k
                    for k, e in self._index.items()
                    if fingerprint is None or e.fingerprint == fingerprint
                ]
            with self._backend("clear"):
                if fingerprint is None:
                    with self._env.begin(write=True) as txn:
                        txn.drop(self._records, delete=False)
                        txn.drop(self._meta, delete=False)
                else:
                    for i in range(0, len(keys), 4096):  # bound the dirty pages of one txn
                        self._write(deletes=keys[i : i + 4096])
            with self._lock:
                return self._drop_from_index(keys)

    def pin(self, key: ChunkKey, pinned: bool = True) -> bool:
        self._check_open()
        with self._wlock:
            self._check_open()
            with self._lock:
                e = self._index.get(bytes(key))
                if e is None:
                    return False
                e.pinned = pinned
                self._dirty.discard(bytes(key))
                snapshot = replace(e)
            with self._backend("pin"):
                self._write(metas={bytes(key): snapshot})
            return True

    def flush(self) -> int:
        """Write back in-memory access times and hit counts; returns how many entries."""
        self._check_open()
        with self._wlock:
            metas = self._take_dirty()
            if not metas:
                return 0
            try:
                with self._backend("flush"):
                    self._write(metas=metas)
            except TierError:
                self._restore_dirty(metas)
                raise
            return len(metas)

    # -- reads ----------------------------------------------------------------
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

    def _drop_corrupt(self, key: bytes, why: str) -> None:
        # Should the key have been deleted and put again since it was read, this deletes
        # a good record: a later miss, never wrong bytes.
        log.warning("disk tier %s: deleting damaged record %s: %s", self.path, key.hex(), why)
        with self._wlock:
            self._check_open()
            try:
                with self._backend("delete damaged record"):
                    self._write(deletes=[key])
            except TierError as e:
                # LMDB cannot free a value whose overflow pages are zeroed or overwritten
                # (MDB_CORRUPTED). Forgotten here all the same, so the record is a miss
                # (and lower tiers are asked), not an error at every read of it.
                log.warning("disk tier %s: %s; the record is dropped from the index", self.path, e)
            with self._lock:
                self._drop_from_index([key])
                self._n["corrupt"] += 1
        self._report_corrupt(ChunkKey(key))

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

    def stats(self) -> TierStats:
        """Never raises, even after close (then ``healthy`` is false)."""
        with self._lock:
            n = self._n
            s = TierStats(
                name=self.name,
                level=self.level,
                capacity_bytes=self.config.capacity_bytes,
                used_bytes=self._used,
                chunks=len(self._index),
                healthy=self._healthy,
                hits=n["hits"],
                misses=n["misses"],
                puts=n["puts"],
                evictions=n["evictions"],
                corrupt=n["corrupt"],
                errors=n["errors"],
                rejected=n["rejected"],
                bytes_in=n["bytes_in"],
                bytes_out=n["bytes_out"],
            )
            dirty = len(self._dirty)
        detail: dict[str, Any] = {
            "path": self.path,
            "codec": self._codec.name.lower(),
            "durability": self.config.durability,
            "dirty_access": dirty,
            "last_error": self._last_error,
            "loans": len(self.loans),  # records lent in place now (``lend``)
            "lent": self.loans.lent,  # since the start
            "loans_expired": self.loans.expired,
        }
        if self._closed:
            s.healthy, s.detail = False, detail
            return s
        try:
            info = self._env.info()
            detail.update(
                map_size=info["map_size"],
                last_txnid=info["last_txnid"],
                num_readers=info["num_readers"],
                page_size=self._env.stat()["psize"],
            )
            detail["file_size"] = os.path.getsize(os.path.join(self.path, DATA_FILE))
        except (lmdb.Error, OSError) as e:
            s.healthy = False
            detail["stats_error"] = str(e)
        s.detail = detail
        return s

    # -- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        """Write back access info, sync to disk, close LMDB and release the directory."""
        with self._wlock:
            if self._closed:
                return
            try:
                metas = self._take_dirty()
                if metas:
                    self._write(metas=metas)
                self._env.sync(True)
            except lmdb.Error as e:
                log.warning(
                    "disk tier %s: could not write back access info at close: %s", self.path, e
                )
            finally:
                self._closed = True
                self.loans.close()  # no read transaction may outlive the env
                self._env.close()
                self._unlock()

    def _unlock(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = ()
