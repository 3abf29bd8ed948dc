"""Many leases' payloads copied into one buffer in parts, each part of every payload in
one call: a paged KV cache loaded one layer of every chunk at a time, so the engine can
compute with a layer while the next one is copied.

Each payload is hashed as one stream across its parts, where its bytes landed, so the
copy is still one pass; the verdict on a payload comes only after its last part. A
caller that uses a part before then must be able to take it back (vLLM recomputes the
blocks of a load reported failed, and drops the step's output for that request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore import accel
from kvstore.arena import as_u8
from kvstore.errors import InvalidArgument
from kvstore.sdk.shm import LeaseBase

__all__ = ["ScatterBatch"]


class ScatterBatch:
    """Payloads of leases copied into ``out`` part by part: ``add`` each lease with its
    parts, ``copy(0)``, ``copy(1)``, ... in order, then ``verified()``.

    Not thread-safe, but any one thread may call ``copy`` (the GIL is let go for the
    bytes): the engine thread adds the leases, a copying thread copies.
    """

    def __init__(self, out: Any) -> None:
        self._out = as_u8(out, writable=True)
        self._leases: list[LeaseBase] = []
        # Per part, per source mapping (the arena; L2's file): its spans, in the native
        # call's form: (offset in the mapping, offset in out, length, payload index).
        self._parts: list[dict[int, tuple[Any, list[tuple[int, int, int, int]]]]] = []
        self._streams: Any = None
        self._next = 0  # the part ``copy`` does next

    @property
    def parts(self) -> int:
        return len(self._parts)

    def add(self, lease: LeaseBase, parts: Sequence[Sequence[tuple[int, int]]]) -> int:
        """Add a lease whose payload goes to ``parts``: per part, (offset in ``out``,
        length) pieces, in payload order; all the parts together cover the payload
        exactly once. Its index in ``verified()``."""
        if self._streams is not None:
            raise InvalidArgument("ScatterBatch.add after the copies began")
        k = len(self._leases)
        src = lease._arena.array
        start = 0
        for i, pieces in enumerate(parts):
            trips = lease._trips(pieces, start, whole=i == len(parts) - 1)
            start += sum(n for _, n in pieces)
            while len(self._parts) <= i:
                self._parts.append({})
            spans = self._parts[i].setdefault(id(src), (src, []))[1]
            spans += [(off, at, n, k) for off, at, n in trips]
        if not parts and lease.header.raw_size:
            raise InvalidArgument(f"no parts for a {lease.header.raw_size}-byte payload")
        self._leases.append(lease)
        return k

    def copy(self, part: int) -> None:
        """Copy part ``part`` of every payload that has one (parts go in order: 0, 1, ...).
        When this returns, the part's bytes are in ``out`` for any thread to read."""
        if part != self._next:
            raise InvalidArgument(f"part {part} copied out of order (next is {self._next})")
        if self._streams is None:
            self._streams = accel.Streams(len(self._leases))
        for src, spans in self._parts[part].values():
            try:
                accel.scatter_streams(self._streams, src, self._out, spans)
            except ValueError as e:  # a piece outside ``out``
                raise InvalidArgument(f"ScatterBatch.copy: {e}") from e
        self._next += 1

    def verified(self) -> list[bool]:
        """After the last part: per lease (in ``add`` order), whether what landed is its
        chunk (the xxh3_64 of the bytes is its header's). False: the mapping held other
        bytes; read the chunk with ``get_into``, where the server verifies it."""
        if self._next != len(self._parts):
            raise InvalidArgument(f"{self._next} of {len(self._parts)} parts copied")
        if self._streams is None:
            self._streams = accel.Streams(len(self._leases))
        return [
            self._streams.digest(k) == lease.header.payload_checksum
            for k, lease in enumerate(self._leases)
        ]
