"""L1's table of holds on its own: ids, expiry on the injected clock, owners, lasting holds."""

from __future__ import annotations

import random

from kvstore.clock import FakeClock
from kvstore.engine.tiers.holds import HoldTable


def table(clock: FakeClock, seed: int = 1) -> HoldTable[str]:
    return HoldTable[str](1.0, clock, random.Random(seed))


def test_a_hold_runs_out_after_lease_s_unless_renewed() -> None:
    clock = FakeClock()
    holds = table(clock)
    a, _ = holds.add("lease", "a", "x")
    b, expires = holds.add("reservation", "b", "x")
    assert expires == clock() + 1.0
    clock.advance(0.6)
    assert holds.renew(b)
    clock.advance(0.6)  # a is 1.2 s old, b was renewed 0.6 s ago
    due = holds.pop_due()
    assert [h.entry for h in due] == ["a"], "only the hold that was not renewed runs out"
    assert holds.get(a) is None and holds.expired == 1
    assert holds.pop_expired(b) is None, "a renewed hold is not expired yet"
    clock.advance(0.5)
    assert [h.entry for h in holds.pop_due()] == ["b"]
    assert len(holds) == 0 and holds.leases == 0 and holds.expired == 2


def test_kinds_share_one_id_space_and_an_id_names_only_its_kind() -> None:
    clock = FakeClock()
    holds = table(clock)
    ids = {holds.add("lease" if i % 2 else "reservation", str(i), "x")[0] for i in range(500)}
    assert len(ids) == 500 and 0 not in ids
    lid = next(i for i in ids if holds.get(i, "lease") is not None)
    assert holds.pop(lid, "reservation") is None, "a lease id must not end a reservation"
    assert holds.leases == 250 and holds.reservations == 250
    hold = holds.pop(lid, "lease")
    assert hold is not None and hold.kind == "lease" and holds.leases == 249


def test_an_owner_loses_its_expiring_holds_and_keeps_its_lasting_ones() -> None:
    clock = FakeClock()
    holds = table(clock)
    holds.add("lease", "mine", "me")
    lasting, _ = holds.add("reservation", "stream", "me", lasting=True)
    other, _ = holds.add("lease", "theirs", "you")
    clock.advance(0.9)
    assert holds.renew_owner("me") == 1, "a lasting hold needs no renewal"
    clock.advance(0.9)
    assert [h.entry for h in holds.pop_due()] == ["theirs"]
    assert [h.entry for h in holds.pop_owner("me")] == ["mine"]
    clock.advance(1e6)
    assert holds.pop_due() == [] and holds.get(lasting) is not None, "lasting holds never expire"
    assert holds.get(other) is None


def test_renewals_do_not_grow_the_expiry_heap_without_bound() -> None:
    clock = FakeClock()
    holds = table(clock)
    hid, _ = holds.add("lease", "a", "x")
    for _ in range(10_000):
        clock.advance(0.1)
        assert holds.renew(hid)
    assert len(holds._expiry) <= 64 + 4 * len(holds), "stale heap entries are dropped"
    clock.advance(1.0)
    assert [h.entry for h in holds.pop_due()] == ["a"]
