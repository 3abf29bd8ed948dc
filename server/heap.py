"""The server's heap and Python's cyclic garbage collector: full collections kept short.

A full collection walks every object the collector tracks, with the GIL held: every
call waits for it. The store keeps about five per chunk it knows (the index's entry,
L1's entry, the header, its fields, the extents) and a process that imported grpc,
numpy and protobuf starts with ~38,000 more, so full collections grow with the store:
22 ms at 5,000 chunks here, ~0.3 µs an object, and hundreds of ms for an index of a
few hundred thousand chunks on disk. A Lookup whose p50 was 0.3 ms had a p99.9 of
28-35 ms at 5,500 chunks from them alone.

Nearly all of these objects live as long as their chunk and are freed by reference
counting; the collector exists for reference cycles, which the store does not make.
So ``keep_full_collections_short`` freezes (``gc.freeze``: the permanent generation,
which collections skip) what is alive once the store is open, and again after any full
collection that took longer than ``pause_ms``: a full collection then walks only what
came to live since. A frozen object is still freed when its last reference goes; what
freezing costs is a cycle that was alive at a freeze and dies later, which is never
reclaimed (a full collection runs just before each freeze, so nothing that is garbage
already is kept).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvstore.server")


class ShortCollections:
    """Installed by ``keep_full_collections_short``; ``remove`` undoes it (for tests)."""

    def __init__(self, pause_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.pause_s = pause_s
        self.freezes = 0  # full collections that took longer than pause_s
        self._clock = clock
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = self._clock()
            return
        took = self._clock() - self._t0
        if took > self.pause_s:
            gc.freeze()  # what survived this collection: every object alive now
            self.freezes += 1
            log.debug(
                "a full garbage collection took %.1f ms: %d objects frozen in all",
                took * 1e3,
                gc.get_freeze_count(),
            )

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def keep_full_collections_short(
    pause_ms: float, clock: Callable[[], float] = time.perf_counter
) -> ShortCollections | None:
    """Collect and freeze what is alive now (the store is open: its index is built), and
    freeze again after every full collection longer than ``pause_ms`` (timed by
    ``clock``); 0 leaves Python's collector as it is (None)."""
    if pause_ms <= 0:
        return None
    gc.collect()
    gc.freeze()
    log.debug(
        "%d objects alive at the start frozen (gc_pause_ms=%g)", gc.get_freeze_count(), pause_ms
    )
    short = ShortCollections(pause_ms / 1000, clock)
    gc.callbacks.append(short)
    return short
