"""The in-memory index: which chunks exist, where, and who their parent is.

The store is the only writer. It holds, per chunk, what lookup needs without
touching a tier: the parent (to find siblings for partial matching), the
sub-hashes of its tokens (to measure a common prefix without keeping token
ids in memory), its namespace, size and the set of tiers that hold it. L1 and
L2 chunks are always in the index (L2's part is rebuilt from LMDB at start);
L3 is shared with other hosts, so the store asks it directly for what the
index does not know.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvstore.keys import ROOT, SUBHASH_BYTES, ChunkKey, Fingerprint, family, sub_hashes
from kvstore.presence import Presence
from kvstore.records import RecordHeader, header_size
from kvstore.types import TierLevel


@dataclass(slots=True)
class Entry:
    parent: ChunkKey
    fingerprint: Fingerprint
    n_tokens: int
    subhashes: bytes  # keys.sub_hashes of the chunk's tokens at the store's granularity
    raw_size: int  # payload bytes, decoded
    record_size: int  # record bytes in RAW form (what L1 holds)
    dtype: str
    tiers: int  # bit (1 << level) for each tier that holds the chunk
    pinned: bool
    created_ms: int
    hits: int = 0
    last_access_ms: int = 0


def tier_levels(mask: int) -> list[int]:
    return [int(lvl) for lvl in TierLevel if mask & (1 << lvl)]


def layout_of(header: RecordHeader) -> tuple[str, int, int]:
    """What a namespace's chunks agree on: dtype, and payload bytes for so many tokens."""
    return header.dtype, header.raw_size, header.n_tokens


# The fastest tier holding a chunk, by tier mask (bits 1..3): lookups ask this per chunk.
FASTEST = [next((int(lvl) for lvl in TierLevel if m & (1 << lvl)), 0) for m in range(16)]

# A partial match looks for the sibling sharing the most leading units with the chunk
# that missed. Scanning a family costs a lookup O(siblings), and some families are huge:
# ROOT's holds every distinct first chunk of a namespace (a miss cost 11 ms at 10,000
# stored prompts, 127 ms at 100,000). A family with more than WIDE children is also
# filed by prefix: each child under (family, its namespace, its sub-hash j) for every
# unit j, sub-hash j naming the chunk's first j+1 units. The deepest entry a query's
# sub-hashes find then holds exactly the siblings of its namespace sharing the most
# units with it: one that shared more would be filed one level deeper. (The namespace:
# a chunk of another one can be stored under this namespace's parent, and must not
# hide this one's siblings.) Entries exist for every shallower level of a deep one, so
# a binary search finds it. It costs one entry per unit (16 at the defaults) for each
# child of a wide family; a chain's families (one child each) cost nothing.
WIDE = 16
SIBLINGS_READ = 64  # of a wide family's best (all as good): the first one is the answer


def _units(subhashes: bytes) -> int:
    return len(subhashes) // SUBHASH_BYTES


def _prefix(group: bytes, fingerprint: bytes, subhashes: bytes, j: int) -> bytes:
    return group + fingerprint + subhashes[j * SUBHASH_BYTES : (j + 1) * SUBHASH_BYTES]


def _prefixes(group: bytes, fingerprint: bytes, subhashes: bytes) -> list[bytes]:
    """Every name a chunk is filed under in a wide family, deepest first: a lookup
    reading meanwhile never finds a deep level without the shallower ones."""
    return [_prefix(group, fingerprint, subhashes, j) for j in reversed(range(_units(subhashes)))]


class Index:
    """Maps keys to entries, parents to children and namespaces to keys.

    Not thread-safe by itself: the store serialises writers with its lock.
    Single dict reads are atomic under the GIL, so lookups read without it.
    """

    def __init__(self, granularity: int, tombstones: int = 65536, *, wide: int = WIDE) -> None:
        self.granularity = granularity
        self.wide = wide  # families with more children are filed by prefix (WIDE above)
        self.entries: dict[ChunkKey, Entry] = {}
        # keys.family -> child keys, in the order they came (a dict: removal is O(1))
        self.children: dict[bytes, dict[ChunkKey, None]] = {}
        self._wide: set[bytes] = set()  # families also filed by prefix (WIDE above)
        # family + sub-hash j -> the children filed there: one, or several in order
        self._by_prefix: dict[bytes, ChunkKey | dict[ChunkKey, None]] = {}
        self.by_ns: dict[Fingerprint, set[ChunkKey]] = {}
        # Why a recently gone key is gone ("evicted", "corrupt", "deleted"), so
        # a lookup can say why a prompt missed. Bounded: old reasons fall off.
        self.gone: OrderedDict[ChunkKey, str] = OrderedDict()
        self._tombstones = tombstones
        # Where first chunks are announced before they become visible (kvstore.presence),
        # for same-host clients to answer misses without a call; None: nowhere.
        self.presence: Presence | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def get(self, key: ChunkKey) -> Entry | None:
        return self.entries.get(key)

    def add(
        self,
        header: RecordHeader,
        level: int,
        *,
        pinned: bool = False,
        last_access_ms: int = 0,
        hits: int = 0,
        prepared: Entry | None = None,
    ) -> Entry:
        """Record that tier ``level`` holds the chunk described by ``header``.

        ``prepared``: the result of ``prepare(header, level)`` for this header, made
        earlier (a put builds it before its copy, while the caches are warm).
        """
        key = header.key
        entry = self.entries.get(key)
        if entry is not None:
            entry.tiers |= 1 << level
            entry.pinned = entry.pinned or pinned
            entry.hits = max(entry.hits, hits)
            entry.last_access_ms = max(entry.last_access_ms, last_access_ms)
            return entry
        entry = prepared or self.prepare(
            header, level, pinned=pinned, last_access_ms=last_access_ms, hits=hits
        )
        if self.presence is not None and header.parent == ROOT and entry.subhashes:
            # Set before the entry is visible: a reader never finds the chunk in the index
            # (by a Lookup) while the filter still says nothing was stored.
            self.presence.add(header.fingerprint, entry.subhashes[:SUBHASH_BYTES])
        self.entries[key] = entry
        group = family(header.parent, header.fingerprint)
        siblings = self.children.setdefault(group, {})
        siblings[key] = None
        if group in self._wide:
            self._file(group, key, entry)
        elif len(siblings) > self.wide:
            for child in siblings:  # filed before a lookup may search the family by prefix
                self._file(group, child, self.entries[child])
            self._wide.add(group)
        self.by_ns.setdefault(header.fingerprint, set()).add(key)
        self.gone.pop(key, None)
        return entry

    def prepare(
        self,
        header: RecordHeader,
        level: int,
        *,
        pinned: bool = False,
        last_access_ms: int = 0,
        hits: int = 0,
    ) -> Entry:
        """The entry ``add`` would create for ``header``, without adding it."""
        n, raw = header.n_tokens, header.raw_size
        return Entry(  # positional, in field order: binding 12 keywords costs ~1 us a put
            header.parent,  # parent
            header.fingerprint,  # fingerprint
            n,  # n_tokens
            sub_hashes(header.token_bytes, self.granularity),  # subhashes
            raw,  # raw_size
            header_size(n) + raw,  # record_size
            header.dtype,  # dtype
            1 << level,  # tiers
            pinned,  # pinned
            header.created_ms,  # created_ms
            hits,  # hits
            last_access_ms or header.created_ms,  # last_access_ms
        )

    def drop_tier(self, key: ChunkKey, level: int, reason: str = "evicted") -> Entry | None:
        """Tier ``level`` no longer holds ``key``; forget the key when no tier does."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        entry.tiers &= ~(1 << level)
        if entry.tiers == 0:
            self.remove(key, reason)
        return entry

    def remove(self, key: ChunkKey, reason: str = "deleted") -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        group = family(entry.parent, entry.fingerprint)
        siblings = self.children.get(group)
        if siblings is not None:
            siblings.pop(key, None)
            if group in self._wide:
                self._unfile(group, key, entry)
            if not siblings:
                del self.children[group]
                self._wide.discard(group)
        members = self.by_ns.get(entry.fingerprint)
        if members is not None:
            members.discard(key)
            if not members:
                del self.by_ns[entry.fingerprint]
        self.gone[key] = reason
        self.gone.move_to_end(key)
        while len(self.gone) > self._tombstones:
            self.gone.popitem(last=False)
        return entry

    def siblings(
        self, group: bytes, fingerprint: bytes, qsub: bytes
    ) -> tuple[Iterable[ChunkKey], int]:
        """The children of family ``group`` that may share the most leading units with a
        chunk of namespace ``fingerprint`` whose sub-hashes are ``qsub``, in the order
        they came, and the most units any of them can share: all of them, or in a wide
        family that namespace's that share the most, each as many (none: no child
        shares its first unit)."""
        # Snapshots: a lookup reads without the store's lock, and iterating a dict that a
        # writer changes raises. tuple() and list(islice()) run in C, under the GIL.
        if group not in self._wide:
            return tuple(self.children.get(group, ())), _units(qsub)
        table = self._by_prefix
        lo, hi, found = 0, _units(qsub), None  # levels below lo are filled, hi and up not
        while lo < hi:
            mid = (lo + hi) // 2
            got = table.get(_prefix(group, fingerprint, qsub, mid))
            if got is None:
                hi = mid
            else:
                lo, found = mid + 1, got
        if found is None:
            return (), 0
        if not isinstance(found, dict):
            return (found,), lo
        # Each shares ``lo`` units: the first is the answer (the rest, in case it goes).
        return list(itertools.islice(found, SIBLINGS_READ)), lo

    def _file(self, group: bytes, key: ChunkKey, entry: Entry) -> None:
        table = self._by_prefix
        for name in reversed(_prefixes(group, entry.fingerprint, entry.subhashes)):
            there = table.get(name)
            if there is None:
                table[name] = key
            elif isinstance(there, dict):
                there[key] = None
            else:
                table[name] = {there: None, key: None}

    def _unfile(self, group: bytes, key: ChunkKey, entry: Entry) -> None:
        table = self._by_prefix
        for name in _prefixes(group, entry.fingerprint, entry.subhashes):
            there = table.get(name)
            if there is None:
                continue
            if not isinstance(there, dict):
                if there == key:
                    del table[name]
                continue
            there.pop(key, None)
            if len(there) == 1:
                table[name] = next(iter(there))

    def keys(self, fingerprint: Fingerprint | None = None) -> list[ChunkKey]:
        if fingerprint is None:
            return list(self.entries)
        return list(self.by_ns.get(fingerprint, ()))

    def items(self, fingerprint: Fingerprint | None = None) -> Iterator[tuple[ChunkKey, Entry]]:
        for key in self.keys(fingerprint):
            entry = self.entries.get(key)
            if entry is not None:
                yield key, entry

    def namespaces(self) -> dict[Fingerprint, int]:
        return {fp: len(keys) for fp, keys in self.by_ns.items()}
