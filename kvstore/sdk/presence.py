"""A client's view of its server's presence filter (``kvstore.presence``).

A same-host client maps the filter the server's Info offers, read-only, and answers a
Lookup whose prompt's first unit was never filed there itself: "nothing stored", the
answer the server would have given, with no round trip. An engine's scheduler waits
for each new request's Lookup in its scheduling loop; on a host where vLLM's threads
hold the cores, that wait was 0.8 ms at the median and 12-15 ms at p99 for a 0.3 ms
call (docs/performance.md), most of what a miss cost the engine.

A clear bit is trusted only from the live server's filter. Before each answer:
- the server vouches for the filter (``live_until``, pushed ahead at each of its
  sweeps, CLOCK_MONOTONIC): a server killed, or stopped, stops vouching within a few
  sweeps, and one that stops cleanly stops at once;
- the file at the offered path is still the offered inode: a server restarted there
  made a new file (a dead server's file is replaced, never rewritten: ``ArenaView.own``);
- its header holds the offered nonce.
Otherwise the answer is "stale": the caller asks Info again and follows what it offers
(``follow``); a server that is gone fails that call, as its Lookup would have.

Lookups answered here are counted by the server too: their number and prompt tokens
ride on this client's next Lookup that reaches it (``asked``), or are told to it in
passing every ``REPORT_EVERY`` lookups or ``REPORT_S`` (``due``).
"""

from __future__ import annotations

import os
import threading
from typing import Literal, NamedTuple

from kvstore.arena import ArenaView
from kvstore.clock import Clock, monotonic
from kvstore.errors import KVStoreError
from kvstore.keys import sub_hashes
from kvstore.presence import Presence
from kvstore.protocol import boot_id
from kvstore.sdk.wire import ServerInfo

Answer = Literal["absent", "ask", "stale"]

# Lookups answered here are told to the server at least this often (by count or by age),
# when no Lookup of this client's carried them meanwhile.
REPORT_EVERY = 256
REPORT_S = 1.0


class _Mapped(NamedTuple):
    """One server's filter as followed: published whole, so that a reader never pairs
    one server's bits with another's granularity or nonce."""

    filter: Presence
    view: ArenaView  # kept mapped while followed
    path: str
    inode: int
    nonce: int
    granularity: int


class PresenceView:
    """The filter a client follows: mapped from the server's Info, checked per answer."""

    def __init__(self, clock: Clock = monotonic) -> None:
        self.clock = clock  # CLOCK_MONOTONIC, as the server vouches in (tests move it)
        self._lock = threading.Lock()
        self._seen: ServerInfo | None = None  # the Info last followed
        self._ident: tuple[str, int, int, int, int] | None = None
        self._mapped: _Mapped | None = None
        self._named: set[bytes] = set()  # namespaces whose description the server has had
        self._pending = [0, 0]  # lookups answered here, and their tokens, not yet reported
        self._reported = clock()  # when the server was last told of them
        self.answered = 0  # lookups answered here, in all

    @property
    def active(self) -> bool:
        return self._mapped is not None

    def follow(self, info: ServerInfo) -> None:
        """Map the filter ``info`` offers, if this host can (the arena's host); drop a
        filter of another server instance. Cheap when nothing changed."""
        with self._lock:
            if info is self._seen:
                return
            self._seen = info
            ident = None
            if info.presence_bytes and info.shm_path and info.boot_id == boot_id():
                ident = (
                    info.shm_path, info.shm_inode, info.presence_offset, info.presence_bytes,
                    info.presence_nonce,
                )  # fmt: skip
            if ident == self._ident:
                return
            self._ident, self._mapped = ident, None
            self._named.clear()  # another server: it has not had their descriptions
            if ident is None:
                return
            path, inode, offset, size, nonce = ident
            try:
                view = ArenaView.open(path, size, writable=False, offset=offset, inode=inode)
            except KVStoreError:
                return  # another file at the path, or none: lookups are asked
            flt = Presence(view.array)
            if flt.nonce() == nonce:
                # The old mapping goes with its last reader: never unmapped under one.
                self._mapped = _Mapped(flt, view, path, inode, nonce, info.granularity)

    def answer(
        self, fingerprint: bytes, token_bytes: memoryview, described: bool, count: bool = True
    ) -> Answer:
        """What to do with a lookup of this prompt. ``absent``: no chunk it could match
        was ever filed (counted here for the server's Stats, unless ``count`` is off: a
        repeated lookup); ``ask``: look it up; ``stale``: the filter is not the live
        server's any more (ask Info again, ``follow`` it). ``described``: the lookup
        names its namespace, which the server learns from its first Lookup."""
        m = self._mapped
        if m is None or len(token_bytes) < m.granularity * 4:
            return "ask"  # a prompt shorter than one unit matches by its whole chunk only
        if described and fingerprint not in self._named:
            return "ask"
        g, flt = m.granularity, m.filter
        if flt.live_until() < self.clock() * 1e9:
            return "stale"
        try:
            if os.stat(m.path).st_ino != m.inode or flt.nonce() != m.nonce:
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
            return self._take()

    def due(self) -> tuple[int, int] | None:
        """Counts to tell the server now, in passing (``client_core.Tell``), where no
        Lookup has carried them for a while: a workload whose every lookup is answered
        here would otherwise never report them. None: not yet."""
        with self._lock:
            n = self._pending[0]
            if n < REPORT_EVERY and not (n and self.clock() - self._reported >= REPORT_S):
                return None
            return self._take()

    def _take(self) -> tuple[int, int]:
        counts = (self._pending[0], self._pending[1])
        self._pending = [0, 0]
        self._reported = self.clock()
        return counts

    def unasked(self, counts: tuple[int, int]) -> None:
        """The Lookup that carried ``counts`` failed: they ride on the next one."""
        with self._lock:
            self._pending[0] += counts[0]
            self._pending[1] += counts[1]
