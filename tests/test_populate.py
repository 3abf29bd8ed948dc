"""``kvstore.sdk.populate``: every page of a range faulted in, nothing written."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest

from kvstore.sdk import populate
from kvstore.testing.memory import resident_fraction

MiB = 1 << 20


@pytest.fixture
def fresh() -> mmap.mmap:
    """16 MiB of anonymous memory never touched (what a large untouched allocation is)."""
    m = mmap.mmap(-1, 16 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    yield m
    m.close()


def test_populate_faults_in_a_range_and_changes_no_byte(fresh: mmap.mmap) -> None:
    arr = np.frombuffer(fresh, dtype=np.uint8)
    base = arr.ctypes.data
    arr[: 2 * MiB] = 7  # a part already in use: its bytes must survive
    assert resident_fraction(base, 16 * MiB) < 0.5, "the fixture's memory was touched already"
    # Not page-aligned on either end: the pages around are faulted in whole.
    if not populate(base + 100, 16 * MiB - 200):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_fraction(base, 16 * MiB) == 1.0, "some pages were not faulted in"
    assert (arr[: 2 * MiB] == 7).all(), "populate changed bytes already written"
    assert not arr[2 * MiB :].any(), "populate wrote into fresh pages"


def test_populate_stops_when_asked(fresh: mmap.mmap) -> None:
    base = np.frombuffer(fresh, dtype=np.uint8).ctypes.data
    stop = threading.Event()
    stop.set()
    assert populate(base, 16 * MiB, stop) is False
    assert resident_fraction(base, 16 * MiB) == 0.0, "a stopped populate faulted pages in"
