"""Listing and bulk removal in the remote tier: scan, clear, delete, pin, the byte
counter and kvstore-side eviction. ``kvstore.engine.tiers.remote`` has the contract."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from kvstore.engine.tiers.base import ChunkInfo, read_already
from kvstore.engine.tiers.remote_base import RemoteBase
from kvstore.engine.tiers.remote_parts import HEAD_GUESS
from kvstore.errors import CorruptRecord, TierError
from kvstore.keys import KEY_BYTES, ROOT, ChunkKey
from kvstore.records import RecordHeader, parse_header

T = TypeVar("T")

BATCH = 256  # keys per pipeline in scans, clears and evictions
_HEX_KEY = re.compile(rb"[0-9a-f]{%d}" % (2 * KEY_BYTES))


class RemoteListing(RemoteBase):
    def delete(self, key: ChunkKey) -> bool:
        self._check_open()
        header = self._read_headers([key])[0]
        return self._remove([(key, header)])[0] > 0

    def clear(self, fingerprint: bytes | None = None) -> int:
        self._check_open()
        with self._touch_lock:
            self._touches.clear()
        if fingerprint is None:
            # Only our own key shapes, so a deployment with prefix "kvs:x" survives ours.
            # (SCAN still returns every key present all along when keys vanish meanwhile.)
            removed, chunk_prefix = 0, f"{self._p}:c:".encode()
            for some in _batched(self._scan_names(f"{self._p}:[ckpns]:*")):
                done = self._pipe("clear", [("delete", n) for n in some])
                removed += sum(
                    1 for n, d in zip(some, done, strict=True) if d and n.startswith(chunk_prefix)
                )
            fixed = (self._sz, self._used, self._lru, self._pin)
            self._pipe("clear", [("delete", k) for k in fixed])
            return removed
        members = self._cmd("clear", "smembers", self._n(fingerprint))
        removed = 0
        for batch in _batched(ChunkKey(bytes(m)) for m in members):
            headers = self._read_headers(batch)
            removed += self._remove(list(zip(batch, headers, strict=True)))[0]
            # Every child of a chunk of this namespace is in this namespace too.
            self._pipe(
                "clear",
                [("delete", name(k, fingerprint)) for k in batch for name in (self._k, self._s)],
            )
        self._pipe(
            "clear",
            [("delete", self._n(fingerprint)), ("delete", self._k(ROOT, fingerprint)),
             ("delete", self._s(ROOT, fingerprint))],
        )  # fmt: skip
        return removed

    def pin(self, key: ChunkKey, pinned: bool = True) -> bool:
        self._check_open()
        if not self._cmd("pin", "exists", self._c(key)):
            return False
        self._cmd("pin", "sadd" if pinned else "srem", self._pin, key)
        return True

    def recount(self) -> tuple[int, int]:
        """Recompute the byte counter from the ``sz`` hash; (chunks, bytes).

        The counter is kept with INCRBY/DECRBY by every host and can drift after
        lost replies or crashes; eviction calls this when the numbers stop adding up.
        """
        total = chunks = 0
        cursor = 0
        while True:
            cursor, page = self._cmd("recount", "hscan", self._sz, cursor, count=1000)
            chunks += len(page)
            total += sum(int(v) for v in page.values())
            if not cursor:
                break
        self._cmd("recount", "set", self._used, total)
        return chunks, total

    def _make_room(self, used: int, size: int) -> bool:
        """Evict LRU unpinned chunks until ``size`` more bytes fit; False if impossible."""
        self._flush_touches(raise_errors=True)
        cap = self.config.capacity_bytes
        recounted = used > cap  # never so with exact books: recount before evicting for it
        if recounted:
            used = self.recount()[1]
        need, freed, skip = used + size - cap, 0, 0
        for _ in range(10_000):  # bounded: a misbehaving server must not spin us forever
            if freed >= need:
                return True
            cands = [
                ChunkKey(bytes(k))
                for k in self._cmd("evict", "zrange", self._lru, skip, skip + BATCH - 1)
            ]
            if not cands:
                if recounted:
                    return False
                # Nothing left to evict yet still over: the counter may have drifted.
                recounted, (_, used) = True, self.recount()
                need, freed, skip = used + size - cap, 0, 0
                continue
            pinned = self._cmd("evict", "smismember", self._pin, cands)
            for key, is_pinned in zip(cands, pinned, strict=True):
                if is_pinned:
                    skip += 1
                elif freed < need:
                    freed += self._evict_one(key)
        return False

    def _evict_one(self, key: ChunkKey) -> int:
        record = self._read("evict", key, None, count=False)  # a bad one is removed there
        header = parse_header(record) if record is not None else None
        if header is not None and self.on_evict is not None:
            self.on_evict(key, header, read_already(record))
        deleted, freed = self._remove([(key, header)])
        if deleted and header is not None:
            self._count(evictions=1)
        return freed

    def scan(self, fingerprint: bytes | None = None) -> Iterator[ChunkInfo]:
        self._check_open()
        return self._scan(fingerprint)

    def _scan(self, fingerprint: bytes | None) -> Iterator[ChunkInfo]:
        if fingerprint is None:
            cut = len(self._p) + 3  # names of other prefixes ("kvs:c:x") match too: skip them
            keys: Iterator[ChunkKey] = (
                ChunkKey(bytes.fromhex(n[cut:].decode()))
                for n in self._scan_names(f"{self._p}:c:*")
                if _HEX_KEY.fullmatch(n[cut:])
            )
        else:
            members = self._cmd("scan", "smembers", self._n(fingerprint))
            keys = (ChunkKey(bytes(m)) for m in members)
        for batch in _batched(keys):
            yield from self._scan_batch(batch, fingerprint)

    def _scan_batch(self, batch: list[ChunkKey], fingerprint: bytes | None) -> Iterator[ChunkInfo]:
        headers = self._read_headers(batch)
        pins = self._cmd("scan", "smismember", self._pin, batch)
        seen: list[float | None] = [None] * len(batch)
        if self.config.capacity_bytes:
            seen = self._cmd("scan", "zmscore", self._lru, batch)
        vanished: list[ChunkKey] = []
        for key, header, pinned, last in zip(batch, headers, pins, seen, strict=True):
            if header is None:
                vanished.append(key)
                continue
            last_ms = int(last * 1000) if last is not None else header.created_ms
            yield ChunkInfo(key, header, header.record_size, bool(pinned), last_ms)
        if vanished:
            self._prune(vanished, fingerprint)

    def _prune(self, keys: list[ChunkKey], fingerprint: bytes | None) -> None:
        """Drop bookkeeping of records that are gone (evicted by the server, say)."""
        with contextlib.suppress(TierError):
            exists = self._pipe("scan", [("exists", self._c(k)) for k in keys])
            gone = [k for k, e in zip(keys, exists, strict=True) if not e]
            self._remove([(k, None) for k in gone])
            if fingerprint is not None and gone:
                self._pipe("scan", [("srem", self._n(fingerprint), *gone)])

    def _read_headers(self, keys: Sequence[ChunkKey]) -> list[RecordHeader | None]:
        """Parsed headers (None: missing or unreadable), by GETRANGE: payloads stay remote."""
        out: list[RecordHeader | None] = [None] * len(keys)
        todo, size = list(range(len(keys))), HEAD_GUESS
        while todo:
            parts = self._pipe("read", [("getrange", self._c(keys[i]), 0, size - 1) for i in todo])
            again = []
            for i, part in zip(todo, parts, strict=True):
                try:
                    out[i] = parse_header(part, expect_key=keys[i])
                except CorruptRecord:
                    if len(part) == size:  # cut short: the header is longer than we read
                        again.append(i)
            todo, size = again, size * 8
        return out

    def _scan_names(self, pattern: str) -> Iterator[bytes]:
        """Key names matching ``pattern``, streamed with SCAN on every (primary) node."""
        if not self.cluster:
            cursor = 0
            while True:
                cursor, names = self._cmd("scan", "scan", cursor, match=pattern, count=1000)
                yield from names
                if not cursor:
                    return
        for node in self._cmd("scan", "get_primaries"):
            cursor = 0
            while True:
                cursors, names = self._cmd(
                    "scan", "scan", cursor, match=pattern, count=1000, target_nodes=node
                )
                yield from names
                cursor = cursors[node.name]
                if not cursor:
                    break


def _batched(items: Iterable[T]) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
