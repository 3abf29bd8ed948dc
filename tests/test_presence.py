"""The presence filter (``kvstore.presence``): its rules on a buffer, and the store that
writes it into its arena file (real shared memory, real LMDB)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.arena import ArenaView
from kvstore.config import DiskConfig, MemoryConfig, StoreConfig
from kvstore.engine.index import Index
from kvstore.engine.store import TieredStore
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.keys import ROOT, SUBHASH_BYTES, sub_hashes, tokens_to_bytes
from kvstore.presence import HASHES, HEADER_BYTES, Presence, region_bytes
from tests.helpers import FP, make_chain

KiB, MiB = 1 << 10, 1 << 20
C, G = 16, 4  # chunk tokens and granularity of the stores here


def _filter(bits_bytes: int) -> Presence:
    p = Presence(np.zeros(region_bytes(bits_bytes), np.uint8))
    p.init()
    return p


def _units(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(SUBHASH_BYTES) for _ in range(n)]


def test_what_was_added_is_never_reported_absent() -> None:
    """A Bloom filter's one promise: no false "absent", here for 20,000 first units in a
    filter small enough (64 KiB) that a good share of other units read "may hold"."""
    p = _filter(64 * KiB)
    added = _units(20_000, 1)
    for u in added:
        p.add(FP, u)
    missing = [u for u in added if not p.may_hold(FP, u)]
    assert not missing, f"{len(missing)} added units read absent"
    others = _units(20_000, 2)
    false_ask = sum(p.may_hold(FP, u) for u in others) / len(others)
    expected = p.fill() ** HASHES
    assert false_ask < 2 * expected + 0.01, (false_ask, expected, p.fill())
    assert 0 < p.fill() < 1


def test_a_unit_of_another_namespace_is_not_present() -> None:
    p = _filter(1 * MiB)
    u = _units(1, 3)[0]
    p.add(FP, u)
    assert p.may_hold(FP, u)
    assert not p.may_hold(bytes(16), u), "the namespace is part of what is filed"
    assert p.set_bits == HASHES, "one entry sets HASHES bits (no collision at this size)"


def test_a_reader_in_another_mapping_sees_the_writers_bits_and_nonce(tmp_path: Path) -> None:
    """The server writes through its mapping of the file; a client reads through a
    read-only mapping of the filter's region alone (from a page offset)."""
    path = tmp_path / "arena"
    offset, bits = 8 * KiB, 64 * KiB
    with open(path, "wb") as f:
        f.truncate(offset + region_bytes(bits))
    writer_view = ArenaView.open(str(path))
    writer = Presence(writer_view.array[offset:])
    nonce = writer.init()
    reader_view = ArenaView.open(str(path), region_bytes(bits), writable=False, offset=offset)
    reader = Presence(reader_view.array)
    assert reader.nonce() == nonce != 0
    u = _units(1, 4)[0]
    assert not reader.may_hold(FP, u)
    writer.add(FP, u)
    assert reader.may_hold(FP, u), "bits set in one mapping are read in the other"
    assert reader.live_until() == 0, "not vouched for until the server says so"
    writer.vouch(123_456_789)
    assert reader.live_until() == 123_456_789
    writer.init()
    assert reader.nonce() != nonce, "a server that takes the file over signs it anew"
    assert not reader.may_hold(FP, u)
    for v in (reader_view, writer_view):
        v.close()


def test_sizes_that_cannot_be_a_filter_are_refused() -> None:
    with pytest.raises(ConfigError, match="power of two"):
        MemoryConfig(presence_bytes=5000)
    with pytest.raises(ConfigError, match="power of two"):
        MemoryConfig(presence_bytes=2048)
    assert MemoryConfig(presence_bytes=0).presence_bytes == 0
    with pytest.raises(InvalidArgument):
        Presence(np.zeros(HEADER_BYTES + 3000, np.uint8))
    assert Presence(np.zeros(HEADER_BYTES + 4096, np.uint8)).nonce() == 0, "not signed yet"


def _config(tmp: Path, presence: int = 64 * KiB) -> StoreConfig:
    return StoreConfig(
        data_dir=str(tmp),
        chunk_tokens=C,
        granularity=G,
        memory=MemoryConfig(capacity_bytes=1 * MiB, page_bytes=4 * KiB, presence_bytes=presence),
        disk=DiskConfig(capacity_bytes=64 * MiB),
    )


def _first_unit(tokens: list[int]) -> bytes:
    return sub_hashes(tokens_to_bytes(tokens[:G]), G)


def test_the_store_files_first_chunks_and_a_restart_files_l2s_again(tmp_path: Path) -> None:
    """Each first chunk's first unit is filed as it is stored (its child's is not: a
    lookup matches nothing without chunk 0), in the arena file after L1's pages. A
    store reopened on the same LMDB files what L2 holds anew, under a new nonce."""
    prompt = list(range(100, 100 + 2 * C))
    other = list(range(900, 900 + C))
    with TieredStore(_config(tmp_path)) as s:
        where = s.presence()
        assert where is not None
        offset, size, nonce = where
        assert offset == s.memory.capacity_bytes and size == region_bytes(64 * KiB)
        assert os.path.getsize(s.arena.path) == offset + size
        reader = Presence(s.arena.array[offset : offset + size])
        assert reader.nonce() == nonce
        assert not reader.may_hold(FP, _first_unit(prompt))
        for h, p in make_chain(prompt, C):
            assert s.put(h, p).ok
        assert reader.may_hold(FP, _first_unit(prompt))
        assert not reader.may_hold(FP, _first_unit(prompt[C:])), "a second chunk is not filed"
        assert not reader.may_hold(FP, _first_unit(other))
        assert s.stats().tiers[0].detail["presence_fill"] > 0
        s.flush()
    with TieredStore(_config(tmp_path)) as s:
        again = s.presence()
        assert again is not None and again[2] != nonce, "a new server signs anew"
        reader = Presence(s.arena.array[again[0] : again[0] + again[1]])
        assert reader.may_hold(FP, _first_unit(prompt)), "L2's chunks filed at the restart"


def test_no_filter_when_configured_off(tmp_path: Path) -> None:
    with TieredStore(_config(tmp_path, presence=0)) as s:
        assert s.presence() is None
        assert os.path.getsize(s.arena.path) == s.memory.capacity_bytes


def test_a_first_chunk_is_filed_before_a_lookup_can_find_it() -> None:
    """The index sets the bits before the entry is visible: a client that checks the
    filter while a chunk is being added never reads "nothing stored" for a chunk the
    server's Lookup would already find."""
    index = Index(G)
    seen: list[bool] = []

    class Watching(Presence):
        def add(self, fingerprint: bytes, unit: bytes) -> None:
            seen.append(any(e.parent == ROOT for e in index.entries.values()))
            super().add(fingerprint, unit)

    index.presence = Watching(np.zeros(region_bytes(4096), np.uint8))
    chain = make_chain(list(range(7, 7 + 2 * C)), C)
    for h, _ in chain:
        index.add(h, 1)
    assert seen == [False], f"filed once, for the first chunk, before it was visible: {seen}"
    assert index.presence.may_hold(FP, _first_unit(list(range(7, 7 + C))))
