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


@pytest.mark.parametrize("impl", ["native", "python"])
def test_advise_covers_the_range_in_pieces_and_reports_a_refusal(
    fresh: mmap.mmap, impl: str
) -> None:
    """``accel.advise`` (under ``populate``, ``prefault`` and ``retire``): every piece
    advised, the last one short; the first refusal's errno, and nothing after it."""
    import ctypes
    import errno

    from kvstore import accel

    if impl == "native" and not accel.NATIVE:
        pytest.skip("kvstore._native is not built here")
    advise = accel._native.advise if impl == "native" else accel._py_advise
    base = np.frombuffer(fresh, dtype=np.uint8).ctypes.data
    page = mmap.PAGESIZE
    populate_write, dontneed, nohugepage = 23, 4, 15
    # Pages, not huge pages (transparent huge pages "always" would fault in 2 MiB around
    # the end of the range): what is resident is then what was advised.
    assert advise(base, 16 * MiB, nohugepage, 16 * MiB) == 0
    # 5 MiB and a page in pieces of 2 MiB: three pieces, the last of 1 MiB and a page.
    if advise(base, 5 * MiB + page, populate_write, 2 * MiB) != 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_fraction(base, 5 * MiB + page) == 1.0, "a piece was not advised"
    assert resident_fraction(base + 5 * MiB + page, page) == 0.0, "advised past the range"
    assert advise(base, 16 * MiB, dontneed, MiB) == 0
    assert resident_fraction(base, 16 * MiB) == 0.0, "MADV_DONTNEED left pages mapped"
    # A start that is not page-aligned is refused at the first piece: nothing advised.
    assert advise(base + 1, 4 * MiB, populate_write, MiB) == errno.EINVAL
    assert resident_fraction(base, 16 * MiB) == 0.0, "advised after a refusal"
    # The second of three pieces refused (read-only: it cannot be faulted in for
    # writing): the first was advised, the third was not.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(base + 9 * MiB, MiB, mmap.PROT_READ) == 0
    assert advise(base + 8 * MiB, 3 * MiB, populate_write, MiB) != 0
    assert resident_fraction(base + 8 * MiB, MiB) == 1.0, "the piece before the refusal"
    assert resident_fraction(base + 10 * MiB, MiB) == 0.0, "a piece after the refusal"
    with pytest.raises(ValueError, match="piece"):
        advise(base, MiB, populate_write, 0)
    assert advise(base, 0, populate_write, MiB) == 0  # nothing to do
