"""Partial prefix matching with min_length semantics (DESIGN section 3).

1. Walk the chain of chunk keys of the prompt; count the longest run of leading
   chunks present in some tier. The local index answers for L1/L2; where it
   stops, the remote tier is asked about the rest of the chain in one round
   trip, so a prefix may span all three tiers.
2. Where the run stops, a stored sibling (same parent) may still share its first
   tokens with the query: the query diverges mid-chunk, or is shorter or longer
   than the stored chunk. The common prefix counts, rounded down to whole
   granularity units (the seed's min_length rule: two sequences match on their
   first min(len(a), len(b)) tokens when those agree).
3. The total is rounded down to the caller's granularity (the engine's block
   size); below ``min_tokens`` it is reported as 0.

Cost: one hash per chunk of the prompt, one dict probe per chunk, and one
comparison per sibling at the stopping point. Nothing scales with store size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.index import FASTEST, Index
from kvstore.keys import (
    ROOT,
    ChunkKey,
    Fingerprint,
    Namespace,
    chunk_key,
    common_units,
    family,
    split_chunks,
    sub_hashes,
    tokens_to_bytes,
)


class RemoteView(Protocol):
    """What lookup needs from a shared tier that the local index does not cover."""

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def children(self, parent: ChunkKey, fingerprint: bytes | None = None) -> dict[ChunkKey, bytes]:
        """Stored children of ``parent`` in namespace ``fingerprint``, with their token ids."""
        ...


class ChunkMatch(NamedTuple):
    """One stored chunk that serves part of the prompt (a tuple: a lookup makes hundreds)."""

    key: ChunkKey
    start: int  # offset of the chunk's first token in the prompt
    tokens: int  # tokens of the prompt it serves (fewer than stored when partial)
    stored_tokens: int  # tokens the stored chunk holds
    tier: int  # the fastest tier that holds it: 1 memory, 2 disk, 3 remote
    partial: bool  # True when only a prefix of the stored chunk matches


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
    chunks: tuple[ChunkMatch, ...] = ()
    stop: str = "not_stored"  # one of STOP_REASONS: why matching ended where it did
    stop_chunk: int = -1  # index of the chunk where matching ended; -1 when complete
    by_tier: dict[int, int] = field(default_factory=dict)  # matched tokens per tier
    other_namespaces: tuple[NamespaceMatch, ...] = ()  # explain: namespaces that match more


def lookup(
    index: Index,
    fingerprint: Fingerprint,
    tokens: Sequence[int] | np.ndarray,
    *,
    chunk_tokens: int,
    granularity: int | None = None,
    min_tokens: int = 0,
    remote: RemoteView | None = None,
) -> LookupResult:
    g = granularity or index.granularity
    if g <= 0 or min_tokens < 0:
        raise InvalidArgument("granularity must be > 0 and min_tokens >= 0")
    tb = memoryview(tokens_to_bytes(tokens))
    n = len(tb) // 4
    spans = split_chunks(n, chunk_tokens)
    matches: list[ChunkMatch] = []
    parent = ROOT
    stop_key: ChunkKey | None = None

    for s, e in spans:
        key = chunk_key(parent, fingerprint, tb[s * 4 : e * 4])
        entry = index.entries.get(key)
        if entry is None:
            stop_key = key
            break
        matches.append(
            ChunkMatch(key, s, e - s, entry.n_tokens, FASTEST[entry.tiers & 15], False)
        )
        parent = key

    if remote is not None and len(matches) < len(spans):
        rest: list[ChunkKey] = []
        p = parent
        for s, e in spans[len(matches) :]:
            p = chunk_key(p, fingerprint, tb[s * 4 : e * 4])
            rest.append(p)
        present = remote.contains(rest)
        for key, here in zip(rest, present, strict=True):
            if not here:
                stop_key = key
                break
            s, e = spans[len(matches)]
            matches.append(ChunkMatch(key, s, e - s, e - s, 3, False))
            parent = key

    stop = "complete"
    if len(matches) < len(spans):
        stop = index.gone.get(stop_key, "not_stored") if stop_key else "not_stored"
        s, e = spans[len(matches)]
        best = _best_sibling(index, parent, fingerprint, tb[s * 4 : e * 4], remote)
        if best is not None:
            key, units, stored, tier = best
            matches.append(ChunkMatch(key, s, units * index.granularity, stored, tier, True))
            stop = "diverged"

    matched = sum(m.tokens for m in matches)
    # Where matching ended is a fact of the store, decided before the caller's rounding.
    stop_chunk = -1 if stop == "complete" else sum(1 for m in matches if not m.partial)
    cut = matched // g * g
    if cut < matched:
        matches = _trim(matches, cut)
        if stop == "complete":
            stop = "granularity"
            stop_chunk = sum(1 for m in matches if not m.partial)
        matched = cut
    if matched and matched < min_tokens:
        return LookupResult(0, n, (), "below_min_tokens", len(matches) - 1)
    by_tier: dict[int, int] = {}
    for m in matches:
        by_tier[m.tier] = by_tier.get(m.tier, 0) + m.tokens
    return LookupResult(matched, n, tuple(matches), stop, stop_chunk, by_tier)


def _best_sibling(
    index: Index,
    parent: ChunkKey,
    fingerprint: Fingerprint,
    query: memoryview,
    remote: RemoteView | None,
) -> tuple[ChunkKey, int, int, int] | None:
    """The stored child of ``parent`` sharing the most whole units with ``query``."""
    qsub = sub_hashes(query, index.granularity)
    if not qsub:
        return None
    best: tuple[ChunkKey, int, int, int] | None = None
    for child in index.children.get(family(parent, fingerprint), ()):
        entry = index.entries.get(child)
        if entry is None:
            continue
        units = common_units(qsub, entry.subhashes)
        if units and (best is None or units > best[1]):
            best = (child, units, entry.n_tokens, FASTEST[entry.tiers & 15])
    if remote is not None:
        for child, token_bytes in remote.children(parent, fingerprint).items():
            if child in index.entries:
                continue
            units = common_units(qsub, sub_hashes(token_bytes, index.granularity))
            if units and (best is None or units > best[1]):
                best = (child, units, len(token_bytes) // 4, 3)
    return best


def _trim(matches: list[ChunkMatch], total: int) -> list[ChunkMatch]:
    out: list[ChunkMatch] = []
    left = total
    for m in matches:
        if left <= 0:
            break
        if m.tokens <= left:
            out.append(m)
            left -= m.tokens
        else:
            out.append(ChunkMatch(m.key, m.start, left, m.stored_tokens, m.tier, True))
            left = 0
    return out
