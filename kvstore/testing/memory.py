"""Which pages of this process's memory are resident (mincore(2)): for tests of code that
faults memory in ahead of use (``kvstore.sdk.populate``)."""

from __future__ import annotations

import ctypes
import mmap

from kvstore.sdk.shm import page_span

__all__ = ["resident_fraction"]


def resident_fraction(address: int, nbytes: int) -> float:
    """The share of the pages spanning ``nbytes`` from ``address`` that are in memory now."""
    start, length = page_span(address, nbytes)
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(start, length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) / pages
