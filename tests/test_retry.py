"""Retry, Backoff and CircuitBreaker, on a FakeClock, a recording sleep and seeded
randomness: nothing sleeps, and every jittered schedule is reproducible."""

from __future__ import annotations

import random

import pytest

from kvstore.clock import FakeClock
from kvstore.config import RemoteConfig
from kvstore.errors import ConfigError, TierUnavailable
from kvstore.retry import Backoff, BreakerState, CircuitBreaker, Retry


class Flaky:
    """Fails the first ``failures`` calls with ``exc``, then returns ``value``."""

    def __init__(self, failures: int, exc: type[Exception] = ConnectionError, value: str = "ok"):
        self.failures = failures
        self.exc = exc
        self.value = value
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc(f"failure {self.calls}")
        return self.value


# -- Retry ----------------------------------------------------------------------


def test_retry_succeeds_after_failures_with_exponential_backoff() -> None:
    sleeps: list[float] = []
    retry = Retry(3, 20, sleep=sleeps.append, jitter="none")
    fn = Flaky(3)
    assert retry.call(fn) == "ok"
    assert fn.calls == 4, f"1 try + 3 retries expected, got {fn.calls} calls"
    assert sleeps == [0.02, 0.04, 0.08], f"backoff should double from 20 ms: {sleeps}"


def test_retry_gives_up_and_raises_the_last_error() -> None:
    sleeps: list[float] = []
    retry = Retry(2, 10, sleep=sleeps.append)
    fn = Flaky(10)
    with pytest.raises(ConnectionError, match="failure 3"):
        retry.call(fn)
    assert fn.calls == 3 and retry.attempts == 3
    assert len(sleeps) == 2, "no sleep after the last attempt"


def test_retry_zero_retries_calls_once_and_never_sleeps() -> None:
    sleeps: list[float] = []
    fn = Flaky(1)
    with pytest.raises(ConnectionError):
        Retry(0, 50, sleep=sleeps.append).call(fn)
    assert fn.calls == 1 and sleeps == []


def test_retry_does_not_retry_other_exceptions() -> None:
    sleeps: list[float] = []
    retry = Retry(5, 10, sleep=sleeps.append, retry_on=(ConnectionError,))
    fn = Flaky(1, exc=ValueError)
    with pytest.raises(ValueError):
        retry.call(fn)
    assert fn.calls == 1, "a non-retryable error must propagate at once"
    assert sleeps == []


def test_retry_backoff_is_capped_and_zero_backoff_does_not_sleep() -> None:
    retry = Retry(20, 100, max_backoff_ms=500)
    assert retry.delay_s(10) == 0.5
    sleeps: list[float] = []
    assert Retry(2, 0, sleep=sleeps.append).call(Flaky(2)) == "ok"
    assert sleeps == []


def test_retry_from_config() -> None:
    retry = Retry.from_config(RemoteConfig(retries=4, backoff_ms=7))
    assert (retry.retries, retry.backoff_ms, retry.attempts) == (4, 7, 5)
    assert retry.backoff.jitter == "full", "the remote tier's retries must be jittered"
    with pytest.raises(ValueError):
        Retry(-1, 0)


# -- jitter ---------------------------------------------------------------------


def _sleeps(retry_of: int, **kw: object) -> list[float]:
    """What one call that fails ``retry_of + 1`` times sleeps, under Retry(**kw)."""
    sleeps: list[float] = []
    retry = Retry(retry_of, sleep=sleeps.append, **kw)  # type: ignore[arg-type]
    with pytest.raises(ConnectionError):
        retry.call(Flaky(100))
    return sleeps


def test_full_jitter_stays_under_the_exponential_ceiling() -> None:
    retry = Retry(8, 20, max_backoff_ms=500)
    for seed in range(200):
        sleeps = _sleeps(8, backoff_ms=20, max_backoff_ms=500, rng=random.Random(seed))
        assert len(sleeps) == 8, sleeps
        for n, s in enumerate(sleeps):
            assert 0.0 <= s <= retry.delay_s(n), f"seed {seed}: wait {n} is {s}, over its ceiling"
    assert retry.delay_s(0) == 0.02 and retry.delay_s(7) == 0.5


def test_full_jitter_is_deterministic_with_a_seeded_rng() -> None:
    a = _sleeps(5, backoff_ms=20, rng=random.Random(42))
    b = _sleeps(5, backoff_ms=20, rng=random.Random(42))
    assert a == b, "the same seed must give the same schedule"
    ref = random.Random(42)
    assert a == [ref.uniform(0.0, 0.02 * 2**n) for n in range(5)], a
    assert a != _sleeps(5, backoff_ms=20, rng=random.Random(43)), "another seed, another schedule"


def test_full_jitter_spreads_hosts_that_failed_together() -> None:
    # 100 hosts that saw L3 fail at the same moment: their first retries must not
    # all land at the same instant, as they did without jitter.
    firsts = [_sleeps(1, backoff_ms=100, rng=random.Random(host))[0] for host in range(100)]
    assert len(set(firsts)) == 100, "every host should draw its own wait"
    assert min(firsts) < 0.025 and max(firsts) > 0.075, (min(firsts), max(firsts))
    assert _sleeps(1, backoff_ms=100, jitter="none") == [0.1], "none: the fixed schedule"


def test_decorrelated_jitter_grows_from_the_base_and_stays_capped() -> None:
    for seed in range(200):
        sleeps = _sleeps(
            10, backoff_ms=20, max_backoff_ms=300, jitter="decorrelated", rng=random.Random(seed)
        )
        prev = 0.02
        for n, s in enumerate(sleeps):
            assert 0.02 <= s <= min(0.3, 3 * prev) + 1e-12, f"seed {seed}: wait {n} is {s}"
            prev = s
    again = _sleeps(4, jitter="decorrelated", rng=random.Random(5))
    assert again == _sleeps(4, jitter="decorrelated", rng=random.Random(5))


def test_backoff_rejects_what_it_cannot_do() -> None:
    with pytest.raises(
        ConfigError, match=r"jitter='exponential': allowed full, decorrelated, none"
    ):
        Backoff(20, 100, "exponential")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=">= 0"):
        Backoff(-1, 100)
    with pytest.raises(ConfigError, match=">= 0"):
        Retry(1, 20, max_backoff_ms=-5)
    for jitter in ("full", "decorrelated", "none"):
        waits = Backoff(0, 100, jitter).delays(random.Random(1))
        assert [next(waits) for _ in range(3)] == [0.0] * 3, f"{jitter}: zero backoff waits"


# -- CircuitBreaker -------------------------------------------------------------


def test_breaker_opens_after_threshold_consecutive_failures() -> None:
    clock = FakeClock()
    b = CircuitBreaker(3, 1000, clock=clock)
    for i in range(2):
        b.record_failure(ConnectionError("down"))
        assert b.state is BreakerState.CLOSED, f"still closed after {i + 1} failures"
        assert b.allow()
    b.record_failure(ConnectionError("down"))
    assert b.state is BreakerState.OPEN
    assert not b.allow(), "an open breaker refuses calls"
    assert b.consecutive_failures == 3
    assert b.last_error == "ConnectionError: down"
    assert b.retry_in_s() == pytest.approx(1.0)


def test_breaker_success_resets_the_consecutive_count() -> None:
    b = CircuitBreaker(2, 1000, clock=FakeClock())
    b.record_failure()
    b.record_success()
    b.record_failure()
    assert b.state is BreakerState.CLOSED, "failures were not consecutive"


def test_breaker_half_open_allows_exactly_one_trial_then_closes() -> None:
    clock = FakeClock()
    b = CircuitBreaker(1, 500, clock=clock)
    b.record_failure("boom")
    clock.advance(0.499)
    assert b.state is BreakerState.OPEN and not b.allow(), "cooldown not over yet"
    clock.advance(0.001)
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow(), "the first caller after the cooldown gets the trial"
    assert not b.allow(), "a second caller must wait for the trial's outcome"
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow()
    assert b.consecutive_failures == 0


def test_breaker_failed_trial_reopens_for_another_cooldown() -> None:
    clock = FakeClock()
    b = CircuitBreaker(3, 500, clock=clock)
    b.trip("unreachable at start")
    assert b.state is BreakerState.OPEN
    clock.advance(0.5)
    assert b.allow()
    b.record_failure("still down")
    assert b.state is BreakerState.OPEN, "one failed trial reopens, whatever the threshold"
    assert not b.allow()
    clock.advance(0.5)
    assert b.allow(), "a new trial after the next cooldown"
    assert b.opened_count == 2


def test_breaker_unreported_trial_does_not_wedge() -> None:
    clock = FakeClock()
    b = CircuitBreaker(1, 100, clock=clock)
    b.trip()
    clock.advance(0.1)
    assert b.allow()  # trial taken, outcome never reported
    clock.advance(0.05)
    assert not b.allow()
    clock.advance(0.06)
    assert b.allow(), "a lost trial must not block the breaker forever"


def test_breaker_call_wraps_retry_and_counts_one_failure_per_call() -> None:
    clock = FakeClock()
    sleeps: list[float] = []
    b = CircuitBreaker(2, 1000, clock=clock)
    retry = Retry(2, 10, sleep=sleeps.append)
    fn = Flaky(100)
    with pytest.raises(ConnectionError):
        b.call(fn, retry=retry)
    assert fn.calls == 3 and b.consecutive_failures == 1, "retries are one failed call"
    with pytest.raises(ConnectionError):
        b.call(fn, retry=retry)
    assert b.state is BreakerState.OPEN
    calls = fn.calls
    with pytest.raises(TierUnavailable, match="circuit breaker open"):
        b.call(fn, retry=retry)
    assert fn.calls == calls, "an open breaker must not touch the backend"


def test_breaker_trial_is_a_single_attempt() -> None:
    clock = FakeClock()
    b = CircuitBreaker(1, 1000, clock=clock)
    b.trip()
    clock.advance(1)
    fn = Flaky(100)
    with pytest.raises(ConnectionError):
        b.call(fn, retry=Retry(5, 0))
    assert fn.calls == 1, "a half-open trial probes once, without retries"
    clock.advance(1)
    assert b.call(Flaky(0), retry=Retry(5, 0)) == "ok"
    assert b.state is BreakerState.CLOSED


def test_breaker_non_failure_exceptions_count_as_success() -> None:
    b = CircuitBreaker(1, 1000, clock=FakeClock())
    with pytest.raises(ValueError):
        b.call(Flaky(1, exc=ValueError), failure_on=(ConnectionError,))
    assert b.state is BreakerState.CLOSED, "the remote answered; it is not down"


def test_breaker_snapshot_and_config() -> None:
    clock = FakeClock()
    b = CircuitBreaker.from_config(RemoteConfig(failure_threshold=1, cooldown_ms=2000), clock=clock)
    b.record_failure(TimeoutError("slow"))
    snap = b.snapshot()
    assert snap["state"] == "open" and snap["consecutive_failures"] == 1
    assert snap["last_error"] == "TimeoutError: slow"
    assert snap["retry_in_s"] == 2.0
    b.reset()
    assert b.snapshot()["state"] == "closed"
    with pytest.raises(ValueError):
        CircuitBreaker(0, 10)
