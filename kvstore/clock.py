"""Injected time, so leases, eviction order and breakers are testable without sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]
"""Seconds on a monotonic scale."""

monotonic: Clock = time.monotonic


def wall_ms() -> int:
    return int(time.time() * 1000)


class FakeClock:
    """A clock that moves only when told to; for tests."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
