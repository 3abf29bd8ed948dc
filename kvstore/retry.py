"""Retries with jittered exponential backoff, and a circuit breaker, for remote calls.

``Backoff`` says how long to wait before each retry: exponential from
``base_ms`` (doubling, capped at ``max_ms``) and, by default, with full jitter:
each wait is drawn uniformly between 0 and that ceiling, so the hosts that share
one L3 and saw it fail at the same moment do not all retry at the same moment
("decorrelated" jitter, and "none" for a fixed schedule, are the other choices).
The randomness is injected (a ``random.Random``), so a seeded one makes the
schedule reproducible. ``Retry`` re-runs a failed call a few times, waiting as its
``Backoff`` says, through an injected ``sleep``. ``CircuitBreaker`` stops calling a
remote that keeps failing:

    CLOSED --(failure_threshold consecutive failures)--> OPEN
    OPEN   --(cooldown_ms elapsed on the injected clock)--> HALF_OPEN
    HALF_OPEN: exactly one caller gets a trial call; the others are refused
    trial succeeds --> CLOSED        trial fails --> OPEN (cooldown starts again)

Both are generic: which exceptions count as failures is the caller's choice.
Time comes from an injected clock, so tests move it instead of sleeping.
"""

from __future__ import annotations

import enum
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeVar

from kvstore.clock import Clock, monotonic
from kvstore.config import RemoteConfig, check_choices
from kvstore.errors import ConfigError, TierUnavailable

T = TypeVar("T")

Sleep = Callable[[float], None]
Jitter = Literal["full", "decorrelated", "none"]


@dataclass(frozen=True)
class Backoff:
    """The waits between the tries of one call (see the module docstring)."""

    base_ms: int = 20  # the first wait's ceiling; doubles with every retry
    max_ms: int = 1_000  # no wait is longer
    # full: uniform in [0, ceiling] (AWS's "full jitter"); decorrelated: uniform in
    # [base, 3 x the previous wait], capped; none: the ceiling itself, no spread.
    jitter: Jitter = "full"

    def __post_init__(self) -> None:
        if self.base_ms < 0 or self.max_ms < 0:
            raise ConfigError(
                f"backoff base_ms={self.base_ms} and max_ms={self.max_ms} must be >= 0"
            )
        check_choices(self, "backoff")

    def ceiling_s(self, retry: int) -> float:
        """The longest wait before retry number ``retry`` (0-based): base * 2**retry, capped."""
        return min(self.base_ms * (2**retry), self.max_ms) / 1000.0

    def delays(self, rng: random.Random) -> Iterator[float]:
        """The waits of one call, in seconds, one per retry (endless: take what you need)."""
        retry, prev_ms = 0, float(self.base_ms)
        while True:
            if self.jitter == "none":
                yield self.ceiling_s(retry)
            elif self.jitter == "full":
                yield rng.uniform(0.0, self.ceiling_s(retry))
            else:
                prev_ms = min(float(self.max_ms), rng.uniform(self.base_ms, 3.0 * prev_ms))
                yield prev_ms / 1000.0
            retry += 1


class Retry:
    """Run a call up to ``1 + retries`` times, backing off (jittered) between tries."""

    def __init__(
        self,
        retries: int = 1,
        backoff_ms: int = 20,
        *,
        sleep: Sleep = time.sleep,
        retry_on: tuple[type[BaseException], ...] = (Exception,),
        max_backoff_ms: int = 1_000,
        jitter: Jitter = "full",
        rng: random.Random | None = None,
    ) -> None:
        """``rng``: where the jitter comes from; its own ``random.Random()`` when None
        (seeded from the OS, so two hosts never share a schedule)."""
        if retries < 0:
            raise ConfigError(f"retries={retries} must be >= 0")
        self.retries = retries
        self.backoff = Backoff(backoff_ms, max_backoff_ms, jitter)
        self.retry_on = retry_on
        self._sleep = sleep
        self._rng = random.Random() if rng is None else rng

    @classmethod
    def from_config(
        cls,
        config: RemoteConfig,
        *,
        sleep: Sleep = time.sleep,
        retry_on: tuple[type[BaseException], ...] = (Exception,),
        rng: random.Random | None = None,
    ) -> Retry:
        return cls(config.retries, config.backoff_ms, sleep=sleep, retry_on=retry_on, rng=rng)

    @property
    def attempts(self) -> int:
        return 1 + self.retries

    @property
    def backoff_ms(self) -> int:
        return self.backoff.base_ms

    @property
    def max_backoff_ms(self) -> int:
        return self.backoff.max_ms

    def delay_s(self, retry: int) -> float:
        """The longest wait before retry number ``retry`` (0-based); see ``Backoff``."""
        return self.backoff.ceiling_s(retry)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``; on an exception in ``retry_on``, back off and try again.

        The last exception propagates unchanged once the attempts are used up.
        Exceptions outside ``retry_on`` propagate at once.
        """
        delays = self.backoff.delays(self._rng)
        for _ in range(self.retries):
            try:
                return fn()
            except self.retry_on:
                delay = next(delays)
                if delay > 0:
                    self._sleep(delay)
        return fn()


class BreakerState(enum.Enum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are refused until the cooldown has passed
    HALF_OPEN = "half_open"  # one trial call is allowed


class CircuitBreaker:
    """Closed -> open after N consecutive failures -> half-open after a cooldown.

    Thread-safe. Use ``allow()`` before a call and report it with
    ``record_success()`` / ``record_failure()``, or wrap it with ``call()``.
    """

    def __init__(
        self, failure_threshold: int = 3, cooldown_ms: int = 5_000, *, clock: Clock = monotonic
    ) -> None:
        if failure_threshold < 1 or cooldown_ms <= 0:
            raise ValueError("failure_threshold must be >= 1 and cooldown_ms > 0")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_ms / 1000.0
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0  # consecutive
        self._opened_at = 0.0
        self._trial_started: float | None = None
        self._last_error: str | None = None
        self.opened_count = 0  # how many times the breaker has opened

    @classmethod
    def from_config(cls, config: RemoteConfig, *, clock: Clock = monotonic) -> CircuitBreaker:
        return cls(config.failure_threshold, config.cooldown_ms, clock=clock)

    # -- state ------------------------------------------------------------------
    @property
    def state(self) -> BreakerState:
        """The state now; an open breaker whose cooldown has passed reads HALF_OPEN."""
        with self._lock:
            return self._current()

    def _current(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            return BreakerState.HALF_OPEN
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def retry_in_s(self) -> float:
        """Seconds until an open breaker allows a trial call (0 when it allows calls)."""
        with self._lock:
            if self._current() is not BreakerState.OPEN:
                return 0.0
            return max(0.0, self.cooldown_s - (self._clock() - self._opened_at))

    # -- admission ------------------------------------------------------------
    def allow(self) -> bool:
        """Whether a call may go out now. In HALF_OPEN only the first caller gets True.

        A caller that got True must report the outcome. A trial whose outcome is
        never reported does not wedge the breaker: after another cooldown a new
        trial is allowed.
        """
        return self._admit() is not None

    def _admit(self) -> BreakerState | None:
        """CLOSED (a normal call), HALF_OPEN (the one trial call) or None (refused)."""
        with self._lock:
            state = self._current()
            if state is BreakerState.CLOSED:
                return state
            if state is BreakerState.OPEN:
                return None
            now = self._clock()
            if self._trial_started is not None and now - self._trial_started < self.cooldown_s:
                return None
            self._state = BreakerState.HALF_OPEN
            self._trial_started = now
            return BreakerState.HALF_OPEN

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._state = BreakerState.CLOSED
            self._trial_started = None

    def record_failure(self, error: BaseException | str | None = None) -> None:
        with self._lock:
            self._failures += 1
            if error is not None:
                self._last_error = _describe(error)
            trial_failed = self._state is BreakerState.HALF_OPEN
            if trial_failed or self._failures >= self.failure_threshold:
                self._open()

    def trip(self, error: BaseException | str | None = None) -> None:
        """Open now, whatever the count (e.g. the remote was unreachable at start)."""
        with self._lock:
            self._failures = max(self._failures, 1)
            if error is not None:
                self._last_error = _describe(error)
            self._open()

    def reset(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._trial_started = None

    def _open(self) -> None:
        if self._state is not BreakerState.OPEN:
            self.opened_count += 1
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._trial_started = None

    # -- wrapper ---------------------------------------------------------------
    def call(
        self,
        fn: Callable[[], T],
        *,
        retry: Retry | None = None,
        failure_on: tuple[type[BaseException], ...] = (Exception,),
        name: str = "remote",
    ) -> T:
        """Run ``fn`` through the breaker (and ``retry``, except for a half-open trial).

        Raises ``TierUnavailable`` without calling ``fn`` while the breaker is
        open. Exceptions in ``failure_on`` count as failures and propagate
        unchanged (the caller wraps them); others count as success: the remote
        answered, the call itself was wrong.
        """
        admitted = self._admit()
        if admitted is None:
            raise TierUnavailable(
                f"{name}: circuit breaker open after {self._failures} consecutive failures "
                f"(last error: {self._last_error}); next trial in {self.retry_in_s():.1f}s"
            )
        # A trial is a probe: one attempt, so a still-dead remote costs one deadline.
        trial = admitted is BreakerState.HALF_OPEN
        try:
            result = fn() if retry is None or trial else retry.call(fn)
        except failure_on as e:
            self.record_failure(e)
            raise
        except Exception:
            self.record_success()
            raise
        self.record_success()
        return result

    def snapshot(self) -> dict[str, object]:
        """State, consecutive failures and last error, for stats().detail."""
        with self._lock:
            state = self._current()
            retry_in = (
                max(0.0, self.cooldown_s - (self._clock() - self._opened_at))
                if state is BreakerState.OPEN
                else 0.0
            )
            return {
                "state": state.value,
                "consecutive_failures": self._failures,
                "last_error": self._last_error,
                "opened_count": self.opened_count,
                "retry_in_s": round(retry_in, 3),
            }


def _describe(error: BaseException | str) -> str:
    if isinstance(error, str):
        return error
    return f"{type(error).__name__}: {error}"[:300]
