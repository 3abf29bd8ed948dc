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

The read path (``get``, ``get_into``, ``read_with``, ``lend``, ``contains``, ``scan``) is
``disk_reads.L2Reads``, a mixin.

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
from kvstore.engine.tiers.base import Tier, read_already
from kvstore.engine.tiers.disk_format import (
    DATA_FILE,
    META_FIXED,
    Entry,
    is_disk_full,
    lock_directory,
    open_env,
    pack_meta,
    read_index,
)
from kvstore.engine.tiers.disk_loans import Loans
from kvstore.engine.tiers.disk_reads import L2Reads
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


class DiskTier(L2Reads, Tier):
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
        return self._put(header, lambda: self._encode(header, payload))

    def put_record(self, header: RecordHeader, record: bytes | bytearray) -> PutStatus:
        """A write-down's record goes into LMDB as it is: building it again (``_encode``)
        zero-filled and copied every record once more."""
        if header.codec != self._codec:
            return super().put_record(header, record)  # transcoded: built anew anyway
        self._check_open()
        if len(record) != header.record_size:
            raise InvalidArgument(
                f"record is {len(record)} bytes, its header says {header.record_size}"
            )
        return self._put(header, lambda: record)

    def _put(self, header: RecordHeader, blob_of: Callable[[], bytes | bytearray]) -> PutStatus:
        key = bytes(header.key)
        if key in self._index:
            return PutStatus.EXISTS
        blob = blob_of()  # outside the locks: zstd takes milliseconds
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
