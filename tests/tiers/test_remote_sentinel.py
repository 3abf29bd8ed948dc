"""RemoteTier behind Redis/Valkey Sentinel: a real primary, its replica and a sentinel
(kvstore.testing.redis.SentinelGroup) on free ports; the primary fails over (SENTINEL
FAILOVER, or killed) while the tier is in use."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest

from kvstore.config import RemoteConfig
from kvstore.engine.tiers.remote import RemoteTier
from kvstore.testing.redis import SentinelGroup
from kvstore.types import PutStatus
from tests.tiers.test_remote import pytestmark as pytestmark  # needs both servers
from tests.tiers.test_remote import record
from tests.tiers.test_remote_parts import BIG, big_record

T = TypeVar("T")

TIMEOUT_MS = 300
# The most one call may take: a put is up to three remote calls (value, bookkeeping,
# counter), each two attempts of TIMEOUT_MS and a backoff; slack for a busy machine.
CALL_BOUND_S = 3 * (2 * TIMEOUT_MS + 20) / 1000 + 0.5


def sentinel_tier(url: str) -> RemoteTier:
    return RemoteTier(
        RemoteConfig(
            url=url,
            prefix=f"t{uuid.uuid4().hex[:10]}",
            codec="raw",
            timeout_ms=TIMEOUT_MS,
            connect_timeout_ms=TIMEOUT_MS,
            retries=1,
            backoff_ms=20,
            failure_threshold=3,
            cooldown_ms=300,
        )
    )


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def plain(port: int, flavor: str) -> Any:
    if flavor == "valkey":
        import valkey

        return valkey.Valkey(port=port, socket_timeout=2)
    import redis

    return redis.Redis(port=port, socket_timeout=2)


@pytest.mark.parametrize("how", ["failover", "kill"])
@pytest.mark.parametrize("flavor", ["redis", "valkey"])
def test_tier_keeps_its_deadlines_through_a_failover_and_finds_the_new_primary(
    flavor: str, how: str
) -> None:
    with SentinelGroup(flavor) as group:
        assert group.replica is not None
        old, new = group.primary, group.replica
        tier = sentinel_tier(group.url)
        try:
            small, payload, _ = record(seed=1)
            big, big_payload = big_record(2)
            assert tier.put(small, payload) is PutStatus.STORED
            assert tier.put(big, big_payload.data) is PutStatus.STORED
            assert tier.stats().detail["sentinel"] is True
            group.sync()  # the replica holds both before the primary goes
            if how == "failover":
                group.failover()  # the old primary is demoted: writes to it are READONLY
            else:
                old.kill()  # the sentinel notices after down-after-milliseconds (1 s)

            # Writes the old primary took in its last moments are lost with it (Sentinel
            # replicates asynchronously): a put counts once it is on the new primary.
            out = np.zeros(BIG, np.uint8)
            client = plain(new.port, flavor)
            slowest, landed, i = 0.0, None, 0
            deadline = time.monotonic() + 30
            try:
                while time.monotonic() < deadline and landed is None:
                    h, p, _ = record(seed=100 + i)
                    i += 1
                    status, dt_put = timed(lambda h=h, p=p: tier.put(h, p))
                    got, dt_get = timed(lambda: tier.get_into(big.key, memoryview(out)))
                    slowest = max(slowest, dt_put, dt_get)
                    if (
                        status is PutStatus.STORED
                        and got is not None
                        and group.named_primary() == ("127.0.0.1", new.port)
                        and client.exists(tier._c(h.key))
                    ):
                        landed = h
                    time.sleep(0.05)
                assert landed is not None, (
                    f"after {i} tries the tier had not written to the new primary: {tier.stats()}"
                )
                assert client.exists(tier._c(small.key)), "a record stored before was lost"
            finally:
                client.close()
            assert slowest < CALL_BOUND_S, f"a call took {slowest:.2f}s during the failover"
            assert np.array_equal(out, big_payload), "the record read after failover differs"
            assert tier.get(small.key) is not None
            d = tier.stats().detail
            assert d["refreshes"] + d["rechecks"] >= 1, f"the value path never asked again: {d}"
        finally:
            tier.close()


def test_unreachable_sentinels_at_start_degrade_not_raise() -> None:
    from kvstore.testing.redis import free_port

    tier = sentinel_tier(f"redis+sentinel://127.0.0.1:{free_port()}/nobody")
    try:
        h, p, _ = record(seed=3)
        got, dt = timed(lambda: tier.get(h.key))
        assert got is None and dt < CALL_BOUND_S, (got, dt)
        status, dt = timed(lambda: tier.put(h, p))
        assert status is PutStatus.UNAVAILABLE and dt < CALL_BOUND_S, (status, dt)
        s = tier.stats()
        assert not s.healthy and s.detail["sentinel"] is True, s.detail
    finally:
        tier.close()
