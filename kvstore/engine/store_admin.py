"""The store's management: what an operator (or the CLI) does to stored chunks by key or
by namespace: delete, clear, pin, and list them (``scan``, ``namespaces``).

A mixin of ``kvstore.engine.store.TieredStore`` (``AdminPath``). The index goes first,
under the store's lock, then every tier outside it (the lock order of the store's
docstring); a tier that fails is logged and the others still run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstore.engine.fallback import Fallbacks
from kvstore.engine.index import Entry, Index, tier_levels
from kvstore.engine.tiers.base import Tier
from kvstore.engine.writer import WriteDown
from kvstore.errors import TierError
from kvstore.keys import ChunkKey, Fingerprint
from kvstore.types import ChunkView

log = logging.getLogger("kvstore.engine.store")


class AdminPath:
    if TYPE_CHECKING:  # the store's state and helpers this works on (TieredStore sets them up)
        tiers: list[Tier]
        remote: Tier | None
        index: Index
        _lock: threading.RLock
        _fallbacks: Fallbacks
        _writer: WriteDown
        _layouts: dict[Fingerprint, tuple[str, int, int]]

        def _check_open(self) -> None: ...
        def _may_hold(self, tier: Tier, entry: Entry | None) -> bool: ...

    def delete(self, key: ChunkKey) -> bool:
        self._check_open()
        with self._lock:
            entry = self.index.remove(key, "deleted")
        self._writer.forget(key)
        self._fallbacks.forget(key)
        found = entry is not None
        for tier in self.tiers:
            try:
                found = tier.delete(key) or found
            except TierError as e:
                log.warning("delete of %s from %s failed: %s", key.hex()[:16], tier.name, e)
        return found

    def clear(self, fingerprint: Fingerprint | None = None) -> int:
        """Remove every chunk of a namespace (or everything); returns chunks removed."""
        self._check_open()
        with self._lock:
            keys = self.index.keys(fingerprint)
            for key in keys:
                self.index.remove(key, "deleted")
            if fingerprint is None:
                self._layouts.clear()
            else:
                self._layouts.pop(fingerprint, None)
        self._fallbacks.clear()  # a moment's memory: dropping all of it costs nothing
        for key in keys:
            self._writer.forget(key)
        removed = len(keys)
        for tier in self.tiers:
            try:
                n = tier.clear(fingerprint)
            except TierError as e:
                log.warning("clear of %s failed: %s", tier.name, e)
                continue
            if tier is self.remote:
                removed = max(removed, n)
        return removed

    def pin(self, key: ChunkKey, pinned: bool = True) -> bool:
        """Keep a chunk from eviction in every tier that holds it."""
        self._check_open()
        entry = self.index.get(key)
        found = False
        for tier in self.tiers:
            if tier is self.remote or self._may_hold(tier, entry):
                try:
                    found = tier.pin(key, pinned) or found
                except TierError as e:  # the local tiers are pinned; the remote is best effort
                    log.warning("pin of %s in %s failed: %s", key.hex()[:16], tier.name, e)
        if entry is not None:
            entry.pinned = pinned
        return found

    def scan(self, fingerprint: Fingerprint | None = None) -> Iterator[ChunkView]:
        for key, e in self.index.items(fingerprint):
            yield ChunkView(
                key,
                e.fingerprint,
                e.parent,
                e.n_tokens,
                e.raw_size,
                e.dtype,
                tuple(tier_levels(e.tiers)),
                e.pinned,
                e.created_ms,
                e.last_access_ms,
                e.hits,
            )

    def namespaces(self) -> dict[Fingerprint, int]:
        with self._lock:
            return self.index.namespaces()
