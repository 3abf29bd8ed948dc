"""L1's one table of holds: the leases and reservations it handed out, and when they end.

A hold keeps an arena record's pages put for someone outside the tier's lock: a *lease*
for a reader (the record stays readable, even if deleted, until it is released), a
*reservation* for a writer (the pages are its until it commits or aborts).

- Ids are random 62-bit numbers from one id space, not a sequence: an id is a
  capability, and a client cannot name (commit, abort or release) a hold it was not
  handed, nor take a lease id for a reservation.
- A hold expires ``lease_s`` after it was handed out or last renewed, on the injected
  clock, so a dead client cannot leak pages. A *lasting* hold never expires (the
  server's own streams, which give it back when they end).
- Expiry is a heap of (time, id) entries, stale once a hold is renewed or given back,
  skipped when popped and rebuilt when they outnumber the live holds.

Not thread-safe: ``MemoryTier`` calls it under its lock, and gives back what a hold
kept (a lease's reference, a reservation's pages) for every hold this table returns.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from kvstore.clock import Clock

E = TypeVar("E")
Kind = Literal["lease", "reservation"]


@dataclass(eq=False, slots=True)
class Hold(Generic[E]):
    entry: E  # the tier's record
    owner: str  # the client that holds it ("" for the store's own holds)
    kind: Kind
    expires_at: float  # math.inf for a lasting hold
    checksum_at_commit: bool = False  # a reservation whose header's checksum is a placeholder


class HoldTable(Generic[E]):
    def __init__(self, lease_s: float, clock: Clock, rng: random.Random) -> None:
        self._lease_s, self._clock, self._rng = lease_s, clock, rng
        self._holds: dict[int, Hold[E]] = {}
        self._expiry: list[tuple[float, int]] = []  # (expires_at, id); stale after renew
        self.leases = 0  # how many of the holds are leases
        self.expired = 0  # holds that ran out, ever

    def __len__(self) -> int:
        return len(self._holds)

    @property
    def reservations(self) -> int:
        return len(self._holds) - self.leases

    def add(
        self, kind: Kind, entry: E, owner: str, *, lasting: bool = False, at_commit: bool = False
    ) -> tuple[int, float]:
        """A new hold's id and when it expires."""
        hid = self._rng.getrandbits(62)
        while not hid or hid in self._holds:
            hid = self._rng.getrandbits(62)
        expires = math.inf if lasting else self._clock() + self._lease_s
        self._holds[hid] = Hold(entry, owner, kind, expires, at_commit)
        self.leases += kind == "lease"
        if not lasting:
            self._push(expires, hid)
        return hid, expires

    def get(self, hid: int, kind: Kind | None = None) -> Hold[E] | None:
        """The hold ``hid`` (of ``kind``, if given), expired or not."""
        hold = self._holds.get(hid)
        return hold if hold is not None and kind in (None, hold.kind) else None

    def pop(self, hid: int, kind: Kind | None = None) -> Hold[E] | None:
        """Take the hold out of the table; the caller gives back what it kept."""
        hold = self.get(hid, kind)
        if hold is not None:
            del self._holds[hid]
            self.leases -= hold.kind == "lease"
        return hold

    def pop_expired(self, hid: int) -> Hold[E] | None:
        """The hold, taken out, if it is held and has run out; else None (left as is)."""
        hold = self._holds.get(hid)
        if hold is None or hold.expires_at > self._clock():
            return None
        self.expired += 1
        return self.pop(hid)

    def pop_due(self) -> list[Hold[E]]:
        """Every hold that has run out, taken out."""
        now, out = self._clock(), []
        while self._expiry and self._expiry[0][0] <= now:
            _, hid = heapq.heappop(self._expiry)
            hold = self.pop_expired(hid)  # a stale entry (renewed or given back) is None
            if hold is not None:
                out.append(hold)
        return out

    def renew(self, hid: int) -> bool:
        """``lease_s`` more from now for a hold that has not run out; False if not held."""
        hold = self._holds.get(hid)
        if hold is None:
            return False
        if hold.expires_at != math.inf:
            hold.expires_at = self._clock() + self._lease_s
            self._push(hold.expires_at, hid)
        return True

    def renew_owner(self, owner: str) -> int:
        """Renew every expiring hold of ``owner``; how many."""
        expires, n = self._clock() + self._lease_s, 0
        for hid, hold in self._holds.items():
            if hold.owner == owner and hold.expires_at != math.inf:
                hold.expires_at = expires
                self._push(expires, hid)
                n += 1
        return n

    def pop_owner(self, owner: str) -> list[Hold[E]]:
        """Every expiring hold of ``owner`` (a client went away), taken out. Lasting holds
        stay: only the stream that holds one gives it back."""
        ids = [
            hid
            for hid, hold in self._holds.items()
            if hold.owner == owner and hold.expires_at != math.inf
        ]
        return [h for hid in ids if (h := self.pop(hid)) is not None]

    def entries(self, kind: Kind) -> list[E]:
        return [h.entry for h in self._holds.values() if h.kind == kind]

    def clear(self) -> None:
        self._holds.clear()
        self._expiry.clear()
        self.leases = 0

    def _push(self, expires: float, hid: int) -> None:
        heapq.heappush(self._expiry, (expires, hid))
        if len(self._expiry) > 64 + 4 * len(self._holds):  # mostly given back: rebuild
            self._expiry = [
                (h.expires_at, i) for i, h in self._holds.items() if h.expires_at != math.inf
            ]
            heapq.heapify(self._expiry)
