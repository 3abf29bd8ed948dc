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

from collections.abc import Callable, Sequence
from functools import partial
from itertools import repeat
from typing import Any, Protocol, cast

import numpy as np

from kvstore import accel
from kvstore.errors import InvalidArgument
from kvstore.index import FASTEST, Index
from kvstore.keys import (
    ROOT,
    ChunkKey,
    Fingerprint,
    chunk_prefix,
    common_units,
    family,
    sub_hashes,
    token_view,
)
from kvstore.types import ChunkMatch, LookupResult


class RemoteView(Protocol):
    """What lookup needs from a shared tier that the local index does not cover."""

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def children(self, parent: ChunkKey, fingerprint: bytes | None = None) -> dict[ChunkKey, bytes]:
        """Stored children of ``parent`` in namespace ``fingerprint``, with their token ids."""
        ...


# ChunkMatch rows built in C from columns: the NamedTuple constructor is Python code.
_match_row = cast(Callable[[tuple[Any, ...]], ChunkMatch], partial(tuple.__new__, ChunkMatch))
_FASTEST_BY_MASK = bytes(FASTEST[m & 15] for m in range(256))  # FASTEST for bytes.translate
_LEVELS = sorted(set(FASTEST))  # every value a tier column can hold


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
    if chunk_tokens <= 0:
        raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
    tb = token_view(tokens)
    n, ct = len(tb) // 4, chunk_tokens
    step = ct * 4
    n_chunks = -(-n // ct)
    prefix = chunk_prefix(fingerprint)
    # The hot loop (a 128k-token prompt is 512 chunks): hash, probe, keep, in one C
    # call (accel); the ChunkMatch rows are built below, in C too.
    keys, masks, stop_key = accel.chain_probe(prefix, ROOT, tb, step, index.entries, "tiers")
    tiers = bytearray(masks).translate(_FASTEST_BY_MASK)  # the fastest tier of each chunk
    parent: bytes = keys[-1] if keys else ROOT

    if remote is not None and stop_key is not None:
        rest = [stop_key]
        rest += accel.chain_keys(prefix, stop_key, tb[(len(keys) + 1) * step :], step)
        present = remote.contains(cast(list[ChunkKey], rest))
        stop_key = None
        for key, here in zip(rest, present, strict=True):
            if not here:
                stop_key = key
                break
            keys.append(key)
            tiers.append(3)
            parent = key

    # Equal keys mean equal tokens, so an exact match serves, and its stored chunk
    # holds, exactly the prompt's chunk: chunk_tokens, or fewer for the last one.
    k = len(keys)
    matches = list(
        map(_match_row, zip(keys, range(0, n, ct), repeat(ct), repeat(ct), tiers, repeat(False)))
    )
    levels = sorted((t for t in _LEVELS if t in tiers), key=tiers.index)  # in order of appearance
    by_tier = {t: tiers.count(t) * ct for t in levels}
    matched = min(k * ct, n)
    if k * ct > n:  # the prompt's short last chunk matched
        last = matches[-1]
        short = n - last.start
        matches[-1] = ChunkMatch(last.key, last.start, short, short, last.tier, False)
        by_tier[last.tier] -= k * ct - n

    stop = "complete"
    stop_chunk = -1  # where matching ended is a fact of the store, before the caller's rounding
    if k < n_chunks:
        stop = index.gone.get(ChunkKey(stop_key), "not_stored") if stop_key else "not_stored"
        stop_chunk = k
        s = k * ct
        best = _best_sibling(index, ChunkKey(parent), fingerprint, tb[s * 4 : s * 4 + step], remote)
        if best is not None:
            key, units, n_stored, tier = best
            got = units * index.granularity
            matches.append(ChunkMatch(key, s, got, n_stored, tier, True))
            by_tier[tier] = by_tier.get(tier, 0) + got
            matched += got
            stop = "diverged"

    cut = matched // g * g
    if cut < matched:
        _trim(matches, by_tier, matched - cut)
        if stop == "complete":
            stop = "granularity"
            stop_chunk = len(matches) - (1 if matches and matches[-1].partial else 0)
        matched = cut
    if matched and matched < min_tokens:
        return LookupResult(0, n, (), "below_min_tokens", len(matches) - 1)
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


def _trim(matches: list[ChunkMatch], by_tier: dict[int, int], excess: int) -> None:
    """Take ``excess`` tokens off the end of ``matches`` (and ``by_tier``), in place."""
    while excess > 0:
        m = matches.pop()
        cut = min(m.tokens, excess)
        excess -= cut
        left = by_tier[m.tier] - cut
        if left:
            by_tier[m.tier] = left
        else:
            del by_tier[m.tier]
        if cut < m.tokens:
            left_tokens = m.tokens - cut
            matches.append(ChunkMatch(m.key, m.start, left_tokens, m.stored_tokens, m.tier, True))
