"""The store's drops: a consumer's "I loaded these chunks, delete them" (the seed's
``drop_select``: one-shot prefill/decode transfers that should not occupy the cache).

A drop is a delete that never pulls a chunk from under someone reading it. A chunk no
one holds is deleted from every tier at once. A chunk that another lease (or an
in-process read) holds in L1 when the drop arrives stays stored and readable, and can
be leased again meanwhile; when the last hold on it ends (released, expired, its owner
gone) it is deleted from every tier. The holder of a lease therefore reads its bytes
to the end, and a request of another engine that leased the chunk a moment before the
drop loads it; a request that only looked it up (no lease yet) may miss it and compute
instead, as after any delete. A pinned chunk is never dropped: an operator pinned it
to keep it, and only an explicit delete (or unpin) overrides that.

A mixin of ``kvstore.engine.store.TieredStore`` (``DropPath``). L1 keeps the "dropped,
waiting for its holds" mark on its entry (``MemoryTier.mark_drop``) and hands back the
chunks whose last hold ended (``MemoryTier.take_dropped``); the store deletes those
wherever a hold can end: ``release``, ``release_owner`` and ``upkeep`` (expiry, and the
in-process reads that ended since).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.engine.index import Index
from kvstore.engine.tiers.memory import MemoryTier
from kvstore.keys import ChunkKey


class DropPath:
    if TYPE_CHECKING:  # the store's state and helpers this works on (TieredStore sets them up)
        memory: MemoryTier
        index: Index

        def _check_open(self) -> None: ...
        def _count(self, name: str, n: int = 1) -> None: ...
        def delete(self, key: ChunkKey) -> bool: ...

    def drop(self, keys: Sequence[ChunkKey]) -> tuple[int, int]:
        """Drop chunks: (deleted now, deferred until the last lease on them ends).

        Keys not stored, and pinned chunks, count in neither. Counted in ``stats()``:
        ``dropped`` when a chunk is deleted (now or later), ``drops_deferred`` when a
        drop had to wait.
        """
        self._check_open()
        self._drop_due()  # holds that ended meanwhile first: their chunks may be named again
        now = deferred = 0
        for key in dict.fromkeys(keys):
            entry = self.index.get(key)
            if entry is not None and entry.pinned:
                continue
            holds = self.memory.mark_drop(key)
            if holds:
                deferred += 1
            elif self.delete(key):
                now += 1
        if now:
            self._count("dropped", now)
        if deferred:
            self._count("drops_deferred", deferred)
        return now, deferred

    def _drop_due(self) -> int:
        """Delete the dropped chunks whose last hold has ended; how many."""
        n = sum(self.delete(key) for key in self.memory.take_dropped())
        if n:
            self._count("dropped", n)
        return n
