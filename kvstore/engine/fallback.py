"""What the store decided when L1 could not take a chunk, kept for the caller's next call.

When L1 is full (everything pinned, leased or being evicted) a chunk takes a
fallback path that spans two calls of a client: a Reserve answered FULL is followed
by a Put stream of the same chunk, an Acquire of a chunk read from L2 or L3 that L1
could not take is followed by a Get of it. Each call used to decide again: the FULL
chunk was offered to L1 up to four times (each offer scans for victims) and the L2
hit was read from LMDB three times. This table remembers, for a moment, both:

- ``refused``: keys L1 just refused, so the next offer of the same chunk goes
  straight to the lower tiers without another scan;
- ``records``: records just read from below that L1 could not take, so the
  follow-up read is served from those bytes instead of reading the tier again.

Both are bounded (records by bytes) and expire after ``ttl_s`` on the store's
injected clock; nothing in here is ever the only copy of a chunk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvstore.clock import Clock
from kvstore.keys import ChunkKey


class Fallbacks:
    def __init__(
        self,
        clock: Clock,
        *,
        ttl_s: float = 2.0,
        max_record_bytes: int = 64 << 20,
        max_refused: int = 4096,
    ) -> None:
        self._clock = clock
        self.ttl_s = ttl_s
        self.max_record_bytes = max_record_bytes
        self.max_refused = max_refused
        self._lock = threading.Lock()
        self._refused: OrderedDict[ChunkKey, float] = OrderedDict()  # key -> expiry
        self._records: OrderedDict[ChunkKey, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self.served = 0  # follow-up reads served from a kept record
        self.skipped = 0  # offers to L1 skipped: it had just refused the chunk

    def refuse(self, key: ChunkKey) -> None:
        """L1 refused ``key`` (FULL or TOO_LARGE): the next offer goes below at once."""
        with self._lock:
            self._refused[key] = self._clock() + self.ttl_s
            self._refused.move_to_end(key)
            while len(self._refused) > self.max_refused:
                self._refused.popitem(last=False)

    def refused(self, key: ChunkKey) -> bool:
        """Whether L1 refused ``key`` a moment ago (counted as an offer skipped)."""
        with self._lock:
            until = self._refused.get(key)
            if until is None:
                return False
            if until < self._clock():
                del self._refused[key]
                return False
            self.skipped += 1
            return True

    def keep(self, key: ChunkKey, blob: bytes) -> None:
        """A raw record read from below that L1 could not take: kept for the next read."""
        if len(blob) > self.max_record_bytes:
            return
        with self._lock:
            old = self._records.pop(key, None)
            if old is not None:
                self._bytes -= len(old[0])
            self._records[key] = (blob, self._clock() + self.ttl_s)
            self._bytes += len(blob)
            while self._bytes > self.max_record_bytes:
                _, (gone, _) = self._records.popitem(last=False)
                self._bytes -= len(gone)

    def take(self, key: ChunkKey) -> bytes | None:
        """The kept record of ``key`` (given out once), or None."""
        with self._lock:
            got = self._records.pop(key, None)
            if got is None:
                return None
            self._bytes -= len(got[0])
            if got[1] < self._clock():
                return None
            self.served += 1
            return got[0]

    def forget(self, key: ChunkKey) -> None:
        """The chunk was deleted or stored in L1 after all: nothing to remember of it."""
        with self._lock:
            self._refused.pop(key, None)
            got = self._records.pop(key, None)
            if got is not None:
                self._bytes -= len(got[0])

    def clear(self) -> None:
        with self._lock:
            self._refused.clear()
            self._records.clear()
            self._bytes = 0

    def detail(self) -> dict[str, int]:
        with self._lock:
            return {
                "fallback_records": len(self._records),
                "fallback_bytes": self._bytes,
                "fallback_served": self.served,
                "l1_offers_skipped": self.skipped,
            }
