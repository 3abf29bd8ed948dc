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

Cost: one hash per chunk of the prompt (none when the caller sent the keys: a
``KeyChain``), one dict probe per chunk, and one comparison per sibling at the
stopping point. Nothing scales with store size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import numpy as np

from kvstore import accel
from kvstore.engine.index import FASTEST, Index
from kvstore.errors import InvalidArgument
from kvstore.keys import (
    KEY_BYTES,
    ROOT,
    SUBHASH_BYTES,
    ChunkKey,
    Fingerprint,
    chunk_prefix,
    common_units,
    family,
    sub_hashes,
    token_view,
)
from kvstore.types import ChunkMatches, LookupResult


class RemoteView(Protocol):
    """What lookup needs from a shared tier that the local index does not cover."""

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def siblings(
        self, parent: ChunkKey, fingerprint: bytes, subhashes: bytes, granularity: int
    ) -> dict[ChunkKey, bytes]:
        """Stored children of ``parent`` in namespace ``fingerprint``, with their token ids:
        those sharing the most leading units with a chunk of these sub-hashes (a few)."""
        ...

    def has_children(self, parent: ChunkKey, fingerprint: bytes) -> bool: ...


_FASTEST_BY_MASK = bytes(FASTEST[m & 15] for m in range(256))  # FASTEST for bytes.translate
_LEVELS = sorted(set(FASTEST))  # every value a tier column can hold


class Chain(Protocol):
    """One prompt as lookup walks it: the two ways to feed the one lookup below.

    ``TokenChain`` hashes the prompt's token ids here (the chain of keys, and the
    sub-hashes of the chunk where matching stops); ``KeyChain`` takes both from the
    caller, who hashed them the same way (a client sending 32 bytes a chunk instead of
    1 KiB of token ids). Either way the index walk, the partial-match rule and the
    rounding are the same code.
    """

    n_tokens: int

    def walk(self, index: Index) -> tuple[bytes, list[int], bytes | None]:
        """Keys of the leading chunks the index holds (32 bytes each, concatenated),
        their tier masks, and the first key it lacks (None when every chunk is held)."""
        ...

    def after(self, k: int, key: bytes) -> list[bytes]:
        """Keys of chunks k+1, k+2, ... (after a stop at chunk k, whose key is ``key``)."""
        ...

    def sub_hashes(self, k: int, granularity: int) -> bytes | None:
        """``keys.sub_hashes`` of chunk k's tokens at ``granularity`` (the index's); None
        when they are not known here (a ``KeyChain`` the caller sent without them)."""
        ...

    def missing(self, k: int) -> None:
        """Matching stopped at chunk k, whose sub-hashes are not known, where a stored
        sibling might share its first tokens: the answer counts whole chunks only."""
        ...


class TokenChain:
    """A prompt given as token ids (u32): keys and sub-hashes computed here."""

    def __init__(
        self, fingerprint: Fingerprint, tokens: Sequence[int] | np.ndarray, chunk_tokens: int
    ) -> None:
        self._tb = token_view(tokens)
        self.n_tokens = len(self._tb) // 4
        self._step = chunk_tokens * 4
        self._prefix = chunk_prefix(fingerprint)

    def walk(self, index: Index) -> tuple[bytes, list[int], bytes | None]:
        # The hot loop (a 128k-token prompt is 512 chunks): hash, probe, keep, in one C
        # call (accel).
        keys, masks, stop = accel.chain_probe(
            self._prefix, ROOT, self._tb, self._step, index.entries, "tiers"
        )
        return b"".join(keys), masks, stop

    def after(self, k: int, key: bytes) -> list[bytes]:
        return accel.chain_keys(self._prefix, key, self._tb[(k + 1) * self._step :], self._step)

    def sub_hashes(self, k: int, granularity: int) -> bytes | None:
        s = k * self._step
        return sub_hashes(self._tb[s : s + self._step], granularity)

    def missing(self, k: int) -> None:
        """Never called: the sub-hashes of every chunk of token ids are known here."""


class KeyChain:
    """A prompt given as its chunk keys and sub-hashes, hashed by the caller.

    ``keys``: 32 bytes per chunk of an ``n_tokens`` prompt (the last chunk may be
    short), as ``keys.chunk_keys``. ``subs``: each chunk's ``keys.sub_hashes`` at the
    store's granularity, concatenated (a whole chunk has chunk_tokens / granularity
    entries of 8 bytes, the short last one fewer), or only chunk ``subs_of``'s; empty:
    none sent. Where matching stops at a chunk whose sub-hashes were not sent and a
    stored sibling might share its first tokens, the lookup counts whole chunks and
    ``needs`` names that chunk (the caller asks again with its sub-hashes). A key the
    caller did not hash from its tokens names nothing, or a chunk of the namespace
    asked about; the sub-hashes are its word for its tokens, as token ids would be.
    """

    def __init__(
        self,
        keys: bytes,
        n_tokens: int,
        subs: bytes,
        chunk_tokens: int,
        granularity: int,
        subs_of: int | None = None,
        fingerprint: Fingerprint | None = None,
    ) -> None:
        n_chunks = -(-n_tokens // chunk_tokens) if n_tokens > 0 else 0
        if n_tokens < 0 or len(keys) != KEY_BYTES * n_chunks:
            raise InvalidArgument(
                f"chunk_keys is {len(keys)} bytes; a {n_tokens}-token prompt in chunks of "
                f"{chunk_tokens} tokens has {n_chunks} keys of {KEY_BYTES} bytes"
            )
        per = chunk_tokens // granularity * SUBHASH_BYTES
        tail = (n_tokens % chunk_tokens) // granularity * SUBHASH_BYTES
        if subs_of is not None:
            if not 0 <= subs_of < n_chunks:
                raise InvalidArgument(
                    f"sub_hashes_of={subs_of}: the prompt has chunks 0..{n_chunks - 1}"
                )
            whole = subs_of < n_tokens // chunk_tokens
            want, what = (per if whole else tail), f"chunk {subs_of} of a {n_tokens}-token prompt"
        else:
            want, what = (n_tokens // chunk_tokens) * per + tail, f"a {n_tokens}-token prompt"
        if subs and len(subs) != want:
            raise InvalidArgument(
                f"sub_hashes is {len(subs)} bytes; {what} has {want} ({SUBHASH_BYTES} per "
                f"{granularity} tokens, the server's granularity), or leave it empty"
            )
        self.n_tokens = n_tokens
        self._keys = keys
        self._subs, self._per, self._subs_of = subs, per, subs_of
        self._tail = tail if n_tokens % chunk_tokens else per  # sub-hash bytes of the last
        self.needs: int | None = None  # set by lookup: the chunk whose sub-hashes it lacked
        self.fingerprint = fingerprint  # lookup's, if not given here

    def walk(self, index: Index) -> tuple[bytes, list[int], bytes | None]:
        # A key stands for tokens of the namespace asked about only if its entry is of that
        # namespace: the caller hashed the keys, and keys of another namespace match nothing.
        masks, stop = accel.probe_keys(
            self._keys, index.entries, "tiers", "fingerprint", self.fingerprint
        )
        return self._keys[: len(masks) * KEY_BYTES], masks, stop

    def after(self, k: int, key: bytes) -> list[bytes]:
        keys = self._keys
        return [keys[s : s + KEY_BYTES] for s in range((k + 1) * KEY_BYTES, len(keys), KEY_BYTES)]

    def sub_hashes(self, k: int, granularity: int) -> bytes | None:
        # Hashed by the caller at the granularity the store gave it (its Info), the
        # index's; None: not sent for chunk k.
        if k == len(self._keys) // KEY_BYTES - 1 and self._tail == 0:
            return b""  # a last chunk shorter than one unit: nothing to compare
        if not self._subs:
            return None
        if self._subs_of is not None:
            return self._subs if k == self._subs_of else None
        return self._subs[k * self._per : (k + 1) * self._per]

    def missing(self, k: int) -> None:
        self.needs = k


def lookup(
    index: Index,
    fingerprint: Fingerprint,
    tokens: Sequence[int] | np.ndarray | Chain,
    *,
    chunk_tokens: int,
    granularity: int | None = None,
    min_tokens: int = 0,
    remote: RemoteView | None = None,
) -> LookupResult:
    """The longest stored prefix of a prompt: token ids, or a ``Chain`` (``KeyChain``)."""
    g = granularity or index.granularity
    if g <= 0 or min_tokens < 0:
        raise InvalidArgument("granularity must be > 0 and min_tokens >= 0")
    if chunk_tokens <= 0:
        raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
    chain: Chain = (
        tokens
        if isinstance(tokens, (TokenChain, KeyChain))
        else TokenChain(fingerprint, cast(Sequence[int], tokens), chunk_tokens)
    )
    if isinstance(chain, KeyChain):
        if chain.fingerprint is None:
            chain.fingerprint = fingerprint
        elif chain.fingerprint != fingerprint:
            raise InvalidArgument("the key chain was built for another namespace")
    n, ct = chain.n_tokens, chunk_tokens
    n_chunks = -(-n // ct)
    keys, masks, stop_key = chain.walk(index)
    tiers = bytearray(masks).translate(_FASTEST_BY_MASK)  # the fastest tier of each chunk
    parent: bytes = keys[-KEY_BYTES:] if keys else ROOT

    if remote is not None and stop_key is not None:
        rest = [stop_key, *chain.after(len(keys) // KEY_BYTES, stop_key)]
        present = remote.contains(cast(list[ChunkKey], rest))
        stop_key = None
        found = []
        for key, here in zip(rest, present, strict=True):
            if not here:
                stop_key = key
                break
            found.append(key)
            tiers.append(3)
            parent = key
        keys += b"".join(found)

    # Equal keys mean equal tokens, so an exact match serves, and its stored chunk
    # holds, exactly the prompt's chunk: chunk_tokens, or fewer for the last one.
    k = len(keys) // KEY_BYTES
    rows = _Columns(bytearray(keys), list(range(0, k * ct, ct)), [ct] * k, [ct] * k, tiers)
    levels = sorted((t for t in _LEVELS if t in tiers), key=tiers.index)  # in order of appearance
    by_tier = {t: tiers.count(t) * ct for t in levels}
    matched = min(k * ct, n)
    if k * ct > n:  # the prompt's short last chunk matched
        short = n - rows.start[-1]
        rows.tokens[-1] = rows.stored[-1] = short
        by_tier[tiers[-1]] -= k * ct - n

    stop = "complete"
    stop_chunk = -1  # where matching ended is a fact of the store, before the caller's rounding
    if k < n_chunks:
        stop = index.gone.get(ChunkKey(stop_key), "not_stored") if stop_key else "not_stored"
        stop_chunk = k
        qsub = chain.sub_hashes(k, index.granularity)
        best = None
        if qsub is not None:
            best = _best_sibling(index, ChunkKey(parent), fingerprint, qsub, remote)
        elif _has_siblings(index, ChunkKey(parent), fingerprint, remote):
            chain.missing(k)
        if best is not None:
            key, units, n_stored, tier = best
            got = units * index.granularity
            rows.append(key, k * ct, got, n_stored, tier, True)
            by_tier[tier] = by_tier.get(tier, 0) + got
            matched += got
            stop = "diverged"

    cut = matched // g * g
    if cut < matched:
        rows.trim(by_tier, matched - cut)
        if stop == "complete":
            stop = "granularity"
            stop_chunk = len(rows.start) - (1 if rows.partial and rows.partial[-1] else 0)
        matched = cut
    if matched and matched < min_tokens:
        return LookupResult(0, n, ChunkMatches(), "below_min_tokens", len(rows.start) - 1)
    return LookupResult(matched, n, rows.freeze(), stop, stop_chunk, by_tier)


class _Columns:
    """The matched chunks as lookup builds them: whole chunks in bulk, then at most a
    partial one added and the last few trimmed (``kvstore.types.ChunkMatches``)."""

    def __init__(
        self,
        keys: bytearray,
        start: list[int],
        tokens: list[int],
        stored: list[int],
        tier: bytearray,
    ) -> None:
        self.keys, self.start, self.tokens = keys, start, tokens
        self.stored, self.tier = stored, tier
        self.partial: list[bool] | None = None  # None while no chunk is: the common case

    def append(
        self, key: bytes, start: int, tokens: int, stored: int, tier: int, part: bool
    ) -> None:
        if part and self.partial is None:
            self.partial = [False] * len(self.start)
        self.keys += key
        self.start.append(start)
        self.tokens.append(tokens)
        self.stored.append(stored)
        self.tier.append(tier)
        if self.partial is not None:
            self.partial.append(part)

    def trim(self, by_tier: dict[int, int], excess: int) -> None:
        """Take ``excess`` tokens off the end (and off ``by_tier``)."""
        while excess > 0:
            key = bytes(self.keys[-KEY_BYTES:])
            del self.keys[-KEY_BYTES:]
            start, tokens, stored = self.start.pop(), self.tokens.pop(), self.stored.pop()
            tier = self.tier.pop()
            if self.partial is not None:
                self.partial.pop()
            cut = min(tokens, excess)
            excess -= cut
            left = by_tier[tier] - cut
            if left:
                by_tier[tier] = left
            else:
                del by_tier[tier]
            if cut < tokens:
                self.append(key, start, tokens - cut, stored, tier, True)

    def freeze(self) -> ChunkMatches:
        n = len(self.start)
        partial = (False,) * n if self.partial is None else tuple(self.partial)
        return ChunkMatches(
            bytes(self.keys),
            tuple(self.start),
            tuple(self.tokens),
            tuple(self.stored),
            bytes(self.tier),
            partial,
        )


def _best_sibling(
    index: Index,
    parent: ChunkKey,
    fingerprint: Fingerprint,
    qsub: bytes,
    remote: RemoteView | None,
) -> tuple[ChunkKey, int, int, int] | None:
    """The stored child of ``parent`` sharing the most whole units with the query's
    chunk, given as its sub-hashes ``qsub``."""
    if not qsub:
        return None
    best: tuple[ChunkKey, int, int, int] | None = None
    candidates, most = index.siblings(family(parent, fingerprint), fingerprint, qsub)
    for child in candidates:
        entry = index.entries.get(child)
        if entry is None or entry.fingerprint != fingerprint:
            continue
        units = common_units(qsub, entry.subhashes)
        if units and (best is None or units > best[1]):
            best = (child, units, entry.n_tokens, FASTEST[entry.tiers & 15])
            if units >= most:  # none of the rest shares more: the first of the best
                break
    if remote is not None:
        found = remote.siblings(parent, fingerprint, qsub, index.granularity)
        for child, token_bytes in found.items():
            if child in index.entries:
                continue
            units = common_units(qsub, sub_hashes(token_bytes, index.granularity))
            if units and (best is None or units > best[1]):
                best = (child, units, len(token_bytes) // 4, 3)
    return best


def _has_siblings(
    index: Index, parent: ChunkKey, fingerprint: Fingerprint, remote: RemoteView | None
) -> bool:
    """Whether some stored child of ``parent`` could share a prefix with the query's chunk."""
    if index.children.get(family(parent, fingerprint)):
        return True
    return remote is not None and remote.has_children(parent, fingerprint)
