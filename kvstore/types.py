"""Values both sides of the wire share: put outcomes, lookup results, stats, tier levels.

Part of the core (no I/O, no other layer): the engine produces these, the server
maps them onto the wire (``kvstore.protocol``), and the SDK maps them back, so a
client on a laptop uses the same types without importing the engine.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast, overload

from kvstore.keys import KEY_BYTES, ChunkKey, Fingerprint, Namespace


class TierLevel(enum.IntEnum):
    """The tiers by level; each tier class takes its ``level`` and ``name`` from here."""

    MEMORY = 1  # L1: the shared-memory arena
    DISK = 2  # L2: LMDB
    REMOTE = 3  # L3: Redis or Valkey

    @property
    def label(self) -> str:
        """The tier's name as Stats, the CLI and the metrics show it ("memory", ...)."""
        return self.name.lower()

    @classmethod
    def named(cls, name: str) -> TierLevel:
        """The level of a tier name; ValueError naming the allowed ones."""
        for t in cls:
            if t.label == name:
                return t
        raise ValueError(f"unknown tier {name!r}; allowed: {', '.join(t.label for t in cls)}")


def tier_label(level: int) -> str:
    """The name of a tier level, or ``L<level>`` for one this version does not know."""
    try:
        return TierLevel(level).label
    except ValueError:
        return f"L{level}"


class PutStatus(enum.Enum):
    STORED = "stored"  # the record is now in the tier
    EXISTS = "exists"  # the key was already there; nothing changed
    FULL = "full"  # no room could be made (everything left is pinned or in use)
    TOO_LARGE = "too_large"  # the record is larger than the tier's whole capacity
    UNAVAILABLE = "unavailable"  # a remote tier is down; the write was skipped

    @property
    def ok(self) -> bool:
        return self in (PutStatus.STORED, PutStatus.EXISTS)


@dataclass
class TierStats:
    """Counters of one tier. ``used_bytes`` counts stored record bytes."""

    name: str
    level: int
    capacity_bytes: int
    used_bytes: int = 0
    chunks: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0  # records that failed verification (each deleted)
    errors: int = 0  # backend calls that failed
    rejected: int = 0  # puts refused as FULL, TOO_LARGE or UNAVAILABLE
    bytes_in: int = 0
    bytes_out: int = 0
    healthy: bool = True
    detail: dict[str, object] = field(default_factory=dict)


class ChunkMatch(NamedTuple):
    """One stored chunk that serves part of the prompt (a tuple: a lookup makes hundreds)."""

    key: ChunkKey
    start: int  # offset of the chunk's first token in the prompt
    tokens: int  # tokens of the prompt it serves (fewer than stored when partial)
    stored_tokens: int  # tokens the stored chunk holds
    tier: int  # the fastest tier that holds it: 1 memory, 2 disk, 3 remote
    partial: bool  # True when only a prefix of the stored chunk matches


_row = cast(Any, functools.partial(tuple.__new__, ChunkMatch))  # built in C, not Python


class ChunkMatches(Sequence[ChunkMatch]):
    """A lookup's matched chunks, kept as the columns they travel in; the rows
    (``ChunkMatch``) are made when first read, once. A 128k-token prompt matches 512
    chunks, and making 512 rows in the server, taking them apart again for the wire and
    making them again in the client cost more than the rest of the lookup; a caller who
    reads only ``matched_tokens``, or a slice, makes none. Equal to any sequence of the
    same rows (a tuple of ChunkMatch included).

    The columns, read-only: ``key_bytes`` (the keys, 32 bytes each), ``start``,
    ``tokens``, ``stored_tokens``, ``tier`` and ``partial`` (one entry per chunk, as
    ChunkMatch names them). ValueError if they differ in length."""

    __slots__ = ("_keys", "_partial", "_rows", "_start", "_stored", "_tier", "_tokens")

    def __init__(
        self,
        key_bytes: bytes = b"",
        start: Sequence[int] = (),
        tokens: Sequence[int] = (),
        stored_tokens: Sequence[int] = (),
        tier: Sequence[int] = (),
        partial: Sequence[bool] = (),
    ) -> None:
        n = len(start)
        if not (
            len(key_bytes) == KEY_BYTES * n
            and len(tokens) == len(stored_tokens) == len(tier) == len(partial) == n
        ):
            raise ValueError(
                f"chunk columns differ in length: {len(key_bytes)} key bytes, "
                f"{n} starts, {len(tokens)} tokens, {len(stored_tokens)} stored, "
                f"{len(tier)} tiers, {len(partial)} partial"
            )
        self._keys, self._start, self._tokens = key_bytes, start, tokens
        self._stored, self._tier, self._partial = stored_tokens, tier, partial
        self._rows: tuple[ChunkMatch, ...] | None = None

    @classmethod
    def of(cls, rows: Sequence[ChunkMatch]) -> ChunkMatches:
        """Columns of rows (itself if it is columns already)."""
        if isinstance(rows, ChunkMatches):
            return rows
        if not rows:
            return cls()
        keys, start, tokens, stored, tier, part = zip(*rows, strict=True)
        return cls(b"".join(keys), start, tokens, stored, tier, part)

    @property
    def key_bytes(self) -> bytes:
        return self._keys

    @property
    def start(self) -> Sequence[int]:
        return self._start

    @property
    def tokens(self) -> Sequence[int]:
        return self._tokens

    @property
    def stored_tokens(self) -> Sequence[int]:
        return self._stored

    @property
    def tier(self) -> Sequence[int]:
        return self._tier

    @property
    def partial(self) -> Sequence[bool]:
        return self._partial

    def _columns(self) -> tuple[Sequence[int], ...]:
        return self._start, self._tokens, self._stored, self._tier, self._partial

    def __len__(self) -> int:
        return len(self._start)

    @overload
    def __getitem__(self, i: int) -> ChunkMatch: ...
    @overload
    def __getitem__(self, i: slice) -> ChunkMatches: ...
    def __getitem__(self, i: int | slice) -> ChunkMatch | ChunkMatches:
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            if step != 1:
                return ChunkMatches.of(self.rows()[i])
            keys = self._keys[lo * KEY_BYTES : hi * KEY_BYTES]
            return ChunkMatches(keys, *(c[lo:hi] for c in self._columns()))  # type: ignore[arg-type]
        if self._rows is not None:
            return self._rows[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("chunk index out of range")
        key = self._keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
        return _row((key, *(c[i] for c in self._columns())))

    def rows(self) -> tuple[ChunkMatch, ...]:
        """Every row, made once: later reads take them from here."""
        if self._rows is None:
            kb = self._keys
            keys = (kb[s : s + KEY_BYTES] for s in range(0, len(kb), KEY_BYTES))
            self._rows = tuple(map(_row, zip(keys, *self._columns(), strict=True)))
        return self._rows

    def __iter__(self) -> Iterator[ChunkMatch]:
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes, bytearray)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to tuples, whose hash it cannot share

    def __repr__(self) -> str:
        return f"ChunkMatches({list(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Columns may be a protobuf message's (a client's answer), which do not pickle.
        return ChunkMatches, (self._keys, *(list(c) for c in self._columns()))


STOP_REASONS = (
    "complete",  # every token of the prompt matched
    "not_stored",  # the next chunk was never stored (or was evicted long ago)
    "evicted",  # the next chunk was evicted from every tier
    "corrupt",  # the next chunk failed verification and was deleted
    "deleted",  # the next chunk was deleted by a user
    "diverged",  # a stored sibling shares only part of the next chunk
    "below_min_tokens",  # a match was found but is shorter than min_tokens
    "granularity",  # the match was cut to whole units of the requested granularity
)


@dataclass(frozen=True)
class NamespaceMatch:
    """Another namespace holding more of the same tokens (a lookup with ``explain``)."""

    fingerprint: Fingerprint
    matched_tokens: int
    namespace: Namespace | None = None  # when a client described it


@dataclass(frozen=True)
class LookupResult:
    matched_tokens: int
    total_tokens: int
    chunks: Sequence[ChunkMatch] = field(default_factory=ChunkMatches)  # rows as columns
    stop: str = "not_stored"  # one of STOP_REASONS: why matching ended where it did
    stop_chunk: int = -1  # index of the chunk where matching ended; -1 when complete
    by_tier: dict[int, int] = field(default_factory=dict)  # matched tokens per tier
    other_namespaces: tuple[NamespaceMatch, ...] = ()  # explain: namespaces that match more


@dataclass(frozen=True)
class ChunkView:
    """A chunk as the store knows it, for inspection (``kvstore ls``)."""

    key: ChunkKey
    fingerprint: Fingerprint
    parent: ChunkKey
    n_tokens: int
    raw_size: int
    dtype: str
    tiers: tuple[int, ...]
    pinned: bool
    created_ms: int
    last_access_ms: int
    hits: int


@dataclass
class StoreStats:
    chunks: int
    namespaces: int
    tiers: list[TierStats]
    pending_writes: int = 0
    pending_bytes: int = 0
    write_failures: int = 0
    lookups: int = 0
    lookup_tokens: int = 0
    matched_tokens: int = 0
    gets: int = 0
    hits: int = 0
    puts: int = 0
    rejected_puts: int = 0
    dropped: int = 0  # chunks deleted by consumers' drops (kvstore.engine.store_drops)
    drops_deferred: int = 0  # drops that waited for other leases to end
    extra: dict[str, Any] = field(default_factory=dict)
