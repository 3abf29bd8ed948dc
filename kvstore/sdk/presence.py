"""A client's view of its server's presence filter (``kvstore.presence``).

A same-host client maps the filter the server's Info offers, read-only, and answers a
Lookup whose prompt's first unit was never filed there itself: "nothing stored", the
answer the server would have given, with no round trip. An engine's scheduler waits
for each new request's Lookup in its scheduling loop; on a host where vLLM's threads
hold the cores, that wait was 0.8 ms at the median and 12-15 ms at p99 for a 0.3 ms
call (docs/performance.md), most of what a miss cost the engine.

Trusting a clear bit needs the filter to be the live server's: before each answer the
file at the offered path must still be the offered inode, and its header the offered
nonce. A server that stopped unlinked its file; one that restarted made a new file, or
took the old one over and signed it anew. Then the answer is "stale": the caller asks
Info again and follows what it offers (``follow``).

Lookups answered here are counted by the server too: their number and prompt tokens
ride on this client's next Lookup that reaches it (``take_counts``).
"""

from __future__ import annotations

import os
import threading
from typing import Literal

from kvstore.arena import ArenaView
from kvstore.errors import KVStoreError
from kvstore.keys import sub_hashes
from kvstore.presence import Presence
from kvstore.protocol import boot_id
from kvstore.sdk.wire import ServerInfo

Answer = Literal["absent", "ask", "stale"]


class PresenceView:
    """The filter a client follows: mapped from the server's Info, checked per answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: ServerInfo | None = None  # the Info last followed
        self._id: tuple[str, int, int, int, int] | None = None  # path, inode, offset, size, nonce
        self._view: ArenaView | None = None
        self._filter: Presence | None = None
        self._granularity = 0
        self._named: set[bytes] = set()  # namespaces whose description the server has had
        self._pending = [0, 0]  # lookups answered here, and their tokens, not yet reported
        self.answered = 0  # lookups answered here, in all

    @property
    def active(self) -> bool:
        return self._filter is not None

    def follow(self, info: ServerInfo) -> None:
        """Map the filter ``info`` offers, if this host can (the arena's host); drop a
        filter of another server instance. Cheap when nothing changed."""
        if info is self._seen:
            return
        self._seen = info
        ident = None
        if info.presence_bytes and info.shm_path and info.boot_id == boot_id():
            ident = (
                info.shm_path, info.shm_inode, info.presence_offset, info.presence_bytes,
                info.presence_nonce,
            )  # fmt: skip
        if ident == self._id:
            return
        view = flt = None
        if ident is not None:
            path, inode, offset, size, nonce = ident
            try:
                if os.stat(path).st_ino == inode:
                    view = ArenaView.open(path, size, writable=False, offset=offset)
                    flt = Presence(view.array)
                    if flt.nonce() != nonce:
                        flt = None
            except (OSError, KVStoreError):
                flt = None
        with self._lock:
            if ident != self._id:
                self._named.clear()  # another server: it has not had their descriptions
            # The old mapping is left to the collector, not closed: a lookup of another
            # thread may be reading it (a stale answer there is caught by its checks).
            self._id = ident if flt is not None else None
            self._view, self._filter = (view, flt) if flt is not None else (None, None)
            self._granularity = info.granularity

    def answer(
        self, fingerprint: bytes, token_bytes: memoryview, described: bool, count: bool = True
    ) -> Answer:
        """What to do with a lookup of this prompt. ``absent``: no chunk it could match
        was ever filed (counted here for the server's Stats, unless ``count`` is off: a
        repeated lookup); ``ask``: look it up; ``stale``: the filter is not the live
        server's any more (ask Info again, ``follow`` it). ``described``: the lookup
        names its namespace, which the server learns from its first Lookup."""
        flt, ident, g = self._filter, self._id, self._granularity
        if flt is None or ident is None or len(token_bytes) < g * 4:
            return "ask"  # a prompt shorter than one unit matches by its whole chunk only
        if described and fingerprint not in self._named:
            return "ask"
        path, inode, _, _, nonce = ident
        try:
            if os.stat(path).st_ino != inode or flt.nonce() != nonce:
                return "stale"
        except OSError:
            return "stale"
        if flt.may_hold(fingerprint, sub_hashes(token_bytes[: g * 4], g)):
            return "ask"
        with self._lock:
            if count:
                self._pending[0] += 1
                self._pending[1] += len(token_bytes) // 4
            self.answered += 1
        return "absent"

    def asked(self, fingerprint: bytes, described: bool) -> tuple[int, int]:
        """A Lookup goes to the server: the counts it carries (lookups answered here since
        the last one, and their tokens), and its namespace is known there from now on."""
        with self._lock:
            if described:
                self._named.add(fingerprint)
            counts = (self._pending[0], self._pending[1])
            self._pending = [0, 0]
        return counts
