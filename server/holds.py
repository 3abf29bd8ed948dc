"""Who holds what: the check that a client names only its own holds, and the sessions.

The memory tier keeps the one table of leases and reservations (owner, kind, expiry on
its injected clock; ``MemoryTier.hold_info``); this module adds what a server needs on
top: a client may commit, abort or release only a hold it was handed (same owner, same
kind), a Session stream renews its owner's holds on every ping, and everything an owner
holds is dropped when its last Session stream ends. Holds of owners without a Session
(or of a client that stopped pinging) expire in the tier, which reclaims their pages on
its own (``TieredStore.upkeep``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from kvstore.engine.store import TieredStore
from kvstore.errors import NotFound, ResourceExhausted, StoreClosed

log = logging.getLogger("kvstore.server")


class Holds:
    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._sessions: Counter[str] = Counter()  # owner -> live Session streams

    def claim(self, hid: int, owner: str, kind: str) -> int:
        """Check that ``owner`` holds ``hid`` as a ``kind``; its payload bytes, or NotFound."""
        info = self._store.hold_info(hid)
        if info is None or info[0] != owner or info[1] != kind:
            raise NotFound(
                f"unknown {kind} {hid} (expired, already used, or handed to another session)"
            )
        return info[2]

    def claim_leases(self, ids: list[int], owner: str) -> None:
        """Check that ``owner`` holds every one of these leases; NotFound naming the others."""
        unknown = [
            i for i in ids if (h := self._store.hold_info(i)) is None or h[:2] != (owner, "lease")
        ]
        if unknown:
            raise NotFound(
                f"unknown lease(s) {unknown[:8]} (expired, already released, or "
                "handed to another session)"
            )

    def open_session(self, owner: str, per_owner: int) -> None:
        """One more Session stream of ``owner``; ResourceExhausted past ``per_owner`` (the
        number of Session streams in all is bounded by the watchdog's table)."""
        with self._lock:
            if self._sessions[owner] >= per_owner:
                raise ResourceExhausted(
                    f"session {owner.partition('/')[2][:32]!r} already has "
                    f"{self._sessions[owner]} Session streams "
                    f"(max_session_streams_per_owner={per_owner}); a client needs one"
                )
            self._sessions[owner] += 1

    def renew(self, owner: str) -> None:
        """A ping: every live hold of ``owner`` gets a whole lease from now."""
        try:
            self._store.renew_owner(owner)
        except StoreClosed:
            pass

    def end_session(self, owner: str) -> None:
        """The owner's last Session stream ended: drop everything it holds."""
        with self._lock:
            self._sessions[owner] -= 1
            if self._sessions[owner] > 0:
                return
            del self._sessions[owner]
        try:
            n = self._store.release_owner(owner)
        except StoreClosed:
            return
        if n:
            log.info("session %s ended: dropped %d leases/reservations", owner[:16], n)
