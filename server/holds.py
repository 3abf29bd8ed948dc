"""Leases and reservations handed to clients, tracked per owner (session id).

The memory tier knows holds by id; this table adds who holds what, so that
a client can only commit, abort or release what it was handed, a Session
stream renews its owner's holds on every ping, and everything an owner holds is
dropped when its last Session stream ends. Holds of owners without a Session
(or of a client that stopped pinging) are forgotten here once the tier's lease
has run out; the tier reclaims their pages on its own (``sweep``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from kvstore.errors import KVStoreError, NotFound, ResourceExhausted, StoreClosed
from kvstore.store import TieredStore

log = logging.getLogger("kvstore.server")


@dataclass
class Hold:
    owner: str
    kind: str  # "lease" or "reservation"
    expires: float  # monotonic; pushed forward by each Session ping
    nbytes: int = 0  # payload bytes (for the metrics of a commit)


class Holds:
    def __init__(self, store: TieredStore, lease_s: float) -> None:
        self._store = store
        self._lease_s = lease_s
        self._lock = threading.Lock()
        self._holds: dict[int, Hold] = {}
        self._sessions: Counter[str] = Counter()  # owner -> live Session streams

    def track(self, hid: int, owner: str, kind: str, nbytes: int) -> None:
        with self._lock:
            self._holds[hid] = Hold(owner, kind, time.monotonic() + self._lease_s, nbytes)

    def claim(self, hid: int, owner: str, kind: str) -> Hold:
        """Stop tracking a hold the caller owns; NotFound if it does not own it."""
        with self._lock:
            hold = self._holds.get(hid)
            if hold is None or hold.owner != owner or hold.kind != kind:
                raise NotFound(
                    f"unknown {kind} {hid} (expired, already used, or handed to another session)"
                )
            del self._holds[hid]
            return hold

    def claim_leases(self, ids: list[int], owner: str) -> None:
        """Stop tracking these leases, all or none; NotFound naming the unknown ones."""
        with self._lock:
            unknown = [
                i
                for i in ids
                if (h := self._holds.get(i)) is None or h.owner != owner or h.kind != "lease"
            ]
            if unknown:
                raise NotFound(
                    f"unknown lease(s) {unknown[:8]} (expired, already released, or "
                    "handed to another session)"
                )
            for i in ids:
                del self._holds[i]

    def _drop(self, holds: list[tuple[int, str]]) -> None:
        for hid, kind in holds:
            try:
                if kind == "reservation":
                    self._store.abort(hid)
                else:
                    self._store.release(hid)
            except KVStoreError:
                pass  # expired, or the store is closing: nothing left to give back

    def sweep(self) -> int:
        """Forget holds whose lease ran out; let the tier reclaim their pages."""
        now = time.monotonic()
        with self._lock:
            gone = [(h, v.kind) for h, v in self._holds.items() if v.expires < now - 1.0]
            for hid, _ in gone:
                del self._holds[hid]
        self._drop(gone)
        return len(gone)

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
        with self._lock:
            mine = [h for h, v in self._holds.items() if v.owner == owner]
        lost = []
        for hid in mine:
            try:
                alive = self._store.renew(hid)
            except StoreClosed:
                return
            with self._lock:
                hold = self._holds.get(hid)
                if hold is None:
                    continue
                if alive:
                    hold.expires = time.monotonic() + self._lease_s
                else:
                    lost.append((hid, hold.kind))
                    del self._holds[hid]
        self._drop(lost)

    def end_session(self, owner: str) -> None:
        """The owner's last Session stream ended: drop everything it holds."""
        with self._lock:
            self._sessions[owner] -= 1
            if self._sessions[owner] > 0:
                return
            del self._sessions[owner]
            mine = [(h, v.kind) for h, v in self._holds.items() if v.owner == owner]
            for hid, _ in mine:
                del self._holds[hid]
        self._drop(mine)
        try:
            n = self._store.release_owner(owner)
        except StoreClosed:
            return
        if mine or n:
            log.info(
                "session %s ended: dropped %d leases/reservations", owner[:16], max(len(mine), n)
            )
