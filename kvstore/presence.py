"""The presence filter: which first units a server may hold, readable with no round trip.

A lookup matches nothing unless the prompt's first ``granularity`` tokens are the first
tokens of a stored first chunk of its namespace: an exact match of chunk 0 means equal
tokens, and a partial match of chunk 0 (a stored sibling under ROOT) shares at least its
first whole unit, or it counts nothing (``kvstore.engine.lookup``). So a server that
sets, for every first chunk its index ever held, a bit for (namespace fingerprint, the
chunk's first sub-hash), lets a same-host client answer "nothing stored" itself when
the prompt's bit is clear, exactly as the server would have answered it (stop
``not_stored`` at chunk 0: a chunk the index ever held keeps its bit). A set bit only
says "ask": the Lookup goes to the server as before, which stays the only judge of
what matches. Most lookups of a workload without reuse are misses, each a round trip
the engine's scheduling loop waits for (docs/performance.md, "Session 11").

It is a Bloom filter in the arena file, after L1's pages (``MemoryTier``): bits are only
ever set, before the chunk becomes visible in the index, so a reader in another process
needs no lock; a bit left by a chunk since evicted costs one Lookup. The server's index
sets them (``Index.add``, the one place chunks become visible); a restart builds the
filter anew from L2. It is off where an L3 is shared with other hosts: their chunks are
matched by this server without ever being in its index.

Layout: a header page (magic, the nonce of the server that wrote it, hash count, and the
time it is vouched for until), then a power of two of bytes of bits. A clear bit is
trusted only while the server that writes the filter is alive: it pushes ``live_until``
(CLOCK_MONOTONIC, which every process of the host reads alike) ahead at each of its
sweeps, and a client past it asks the server instead (``kvstore.sdk.presence``). A
server killed with its file left behind, or restarted elsewhere, stops vouching within
that time; one that takes a dead server's file over makes a new file (``ArenaView.own``),
so a client's old mapping never sees another server's writes.
"""

from __future__ import annotations

import secrets
import struct

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument

HEADER_BYTES = 4096  # one page: the bits start page-aligned, so a client can map them alone
MAGIC = b"KVSPRES1"
HASHES = 4  # bits per entry: ~1e-5 false "ask" at 1M first chunks in 8 MiB, 2% at 8M
_HEAD = struct.Struct("<8sQI")  # magic, nonce, hashes
_LIVE = struct.Struct("<q")  # live_until, ns of CLOCK_MONOTONIC, at offset _LIVE_AT
_LIVE_AT = 64  # a cache line of its own: the sweeps write it, readers read it each answer


def region_bytes(bits_bytes: int) -> int:
    """Bytes the filter takes in the arena file for ``bits_bytes`` of bits (0: none)."""
    return HEADER_BYTES + bits_bytes if bits_bytes else 0


def check_bits_bytes(bits_bytes: int) -> str | None:
    """Why ``bits_bytes`` cannot size a filter (None: it can)."""
    if bits_bytes == 0 or (bits_bytes >= 4096 and bits_bytes & (bits_bytes - 1) == 0):
        return None
    return "must be 0 (no filter) or a power of two >= 4096 bytes (e.g. 8MiB)"


class Presence:
    """A filter over its region of a mapped arena (a uint8 array of ``region_bytes``)."""

    def __init__(self, region: np.ndarray) -> None:
        n_bits = (region.size - HEADER_BYTES) * 8
        why = check_bits_bytes(n_bits // 8)
        if region.size <= HEADER_BYTES or why:
            raise InvalidArgument(f"a presence region of {region.size} bytes: the bits {why}")
        self._region = region
        self._head = memoryview(region[:HEADER_BYTES].data)
        self._bits = memoryview(region[HEADER_BYTES:].data)
        self._mask = n_bits - 1
        self.set_bits = 0  # bits set by this writer since init (a reader's stays 0)

    # -- the writer (the server's index, under the store's lock) ---------------------
    def init(self, nonce: int | None = None) -> int:
        """Clear the filter and sign it with a new nonce (a server's start)."""
        nonce = secrets.randbits(63) + 1 if nonce is None else nonce
        self._region[:] = 0
        _HEAD.pack_into(self._head, 0, MAGIC, nonce, HASHES)
        self.set_bits = 0
        return nonce

    def vouch(self, until_ns: int) -> None:
        """Trust this filter's clear bits until ``until_ns`` (CLOCK_MONOTONIC): the writer
        is alive and keeps it (renewed at each sweep; 0: not at all)."""
        _LIVE.pack_into(self._head, _LIVE_AT, until_ns)

    def add(self, fingerprint: bytes, unit: bytes) -> None:
        """A first chunk of namespace ``fingerprint`` whose first sub-hash is ``unit``
        is about to become visible: set its bits first."""
        bits = self._bits
        for pos in self._positions(fingerprint, unit):
            byte, bit = pos >> 3, 1 << (pos & 7)
            old = bits[byte]
            if not old & bit:
                bits[byte] = old | bit
                self.set_bits += 1

    def fill(self) -> float:
        """The share of bits set: a false "ask" costs ~fill ** HASHES of the misses."""
        return self.set_bits / (self._mask + 1)

    # -- a reader --------------------------------------------------------------
    def nonce(self) -> int:
        """The nonce of the server that wrote this filter (0: not a filter)."""
        magic, nonce, hashes = _HEAD.unpack_from(self._head, 0)
        return nonce if magic == MAGIC and hashes == HASHES else 0

    def live_until(self) -> int:
        """Until when (ns of CLOCK_MONOTONIC) the writer vouches for this filter."""
        return int(_LIVE.unpack_from(self._head, _LIVE_AT)[0])

    def may_hold(self, fingerprint: bytes, unit: bytes) -> bool:
        """False: no chunk of this namespace with this first unit was ever filed here."""
        bits = self._bits
        return all(bits[p >> 3] & (1 << (p & 7)) for p in self._positions(fingerprint, unit))

    def _positions(self, fingerprint: bytes, unit: bytes) -> list[int]:
        # Double hashing over one 128-bit digest (Kirsch-Mitzenmacher): as good as
        # HASHES independent hashes for a Bloom filter, at the cost of one.
        d = xxhash.xxh3_128_intdigest(fingerprint + unit)
        h1, h2 = d & 0xFFFFFFFFFFFFFFFF, (d >> 64) | 1
        m = self._mask
        return [(h1 + i * h2) & m for i in range(HASHES)]
