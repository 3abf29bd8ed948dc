"""The arena's pages as the memory tier hands them out: the free-page allocator, and
the reservations (pages a writer fills before its commit) and read leases (a verified
record its holder reads in place) that hold them. Engine-only: clients see holds as
offsets in the server's replies (``kvstore.sdk.shm``), never these objects."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.arena import Extent
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import ChunkKey
from kvstore.records import RecordHeader

__all__ = ["LeaseError", "PageAllocator", "ReadLease", "Reservation"]


class LeaseError(InvalidArgument):
    """A reservation or read lease id is unknown, already used, or expired."""

    code = "NOT_FOUND"  # the call named something the server does not hold (any more)


@dataclass(frozen=True)
class Reservation:
    """Pages reserved for one record; the client writes the payload, then commits."""

    id: int
    key: ChunkKey
    extents: tuple[Extent, ...]  # arena (offset, length), covering exactly the record
    payload_offset: int  # record offset where the payload starts (= header size)
    expires_at: float  # on the tier's clock

    @property
    def record_size(self) -> int:
        return sum(n for _, n in self.extents)


@dataclass(frozen=True)
class ReadLease:
    """A verified record the holder may read in place until it releases the lease."""

    id: int
    key: ChunkKey
    header: RecordHeader
    extents: tuple[Extent, ...]  # the whole record: header, then payload
    expires_at: float
    # the header as packed in the arena (what a client is sent: not packed again per lease)
    packed: bytes

    @property
    def payload_offset(self) -> int:
        return self.header.header_size


class PageAllocator:
    """Free-list allocator over ``n_pages`` pages, handing out runs ``(first page, count)``.

    ``alloc`` tries one contiguous run (best fit, so large holes survive for
    large records) and otherwise takes the largest free runs first, so a request
    fails only when fewer than ``n`` pages are free in total. ``free`` merges a
    run with its neighbours, so free runs are never adjacent.
    """

    def __init__(self, n_pages: int) -> None:
        if n_pages <= 0:
            raise InvalidArgument(f"an arena needs at least one page, got {n_pages}")
        self.n_pages = n_pages
        self._starts: list[int] = [0]  # sorted first pages of the free runs
        self._len: dict[int, int] = {0: n_pages}  # first page -> run length
        self._by_end: dict[int, int] = {n_pages: 0}  # one past the last page -> first page
        self.free_pages = n_pages

    @property
    def fragments(self) -> int:
        """How many separate free runs there are (1 = no fragmentation)."""
        return len(self._starts)

    @property
    def largest_free(self) -> int:
        return max(self._len.values(), default=0)

    def runs(self) -> list[Extent]:
        return [(s, self._len[s]) for s in self._starts]

    def alloc(self, n: int) -> list[Extent] | None:
        """Runs totalling exactly ``n`` pages, sorted by address; None if too few are free."""
        if n <= 0:
            raise InvalidArgument(f"allocate at least one page, got {n}")
        if n > self.free_pages:
            return None
        best = -1
        for s in self._starts:
            length = self._len[s]
            if length >= n and (best < 0 or length < self._len[best]):
                best = s
                if length == n:
                    break
        if best >= 0:
            self._take(best, n)
            return [(best, n)]
        out: list[Extent] = []
        need = n
        for s in sorted(self._starts, key=lambda s: -self._len[s]):
            take = min(need, self._len[s])
            self._take(s, take)
            out.append((s, take))
            need -= take
            if need == 0:
                break
        out.sort()
        return out

    def _take(self, start: int, n: int) -> None:
        length = self._len.pop(start)
        del self._by_end[start + length]
        i = bisect.bisect_left(self._starts, start)
        if n < length:  # the rest of the run stays free, at the same place in the order
            self._starts[i] = start + n
            self._len[start + n] = length - n
            self._by_end[start + length] = start + n
        else:
            del self._starts[i]
        self.free_pages -= n

    def free(self, runs: Sequence[Extent]) -> None:
        for start, n in runs:
            self._free_one(start, n)

    def _free_one(self, start: int, n: int) -> None:
        end = start + n
        i = bisect.bisect_left(self._starts, start)
        prev_end = self._starts[i - 1] + self._len[self._starts[i - 1]] if i > 0 else 0
        next_start = self._starts[i] if i < len(self._starts) else self.n_pages
        if n <= 0 or start < prev_end or end > next_start:
            # A double free would hand the same pages to two records: fail loudly.
            raise KVStoreError(f"arena pages {start}..{end} freed twice or out of range")
        self.free_pages += n
        if start in self._by_end:  # merge with the free run before
            before = self._by_end.pop(start)
            n += self._len.pop(before)
            start = before
            i -= 1
            del self._starts[i]
        if end in self._len:  # merge with the free run after
            n += self._len.pop(end)
            del self._by_end[start + n]
            del self._starts[i]
        self._starts.insert(i, start)
        self._len[start] = n
        self._by_end[start + n] = start
