"""L2's loans over real LMDB: records lent where they lie in ``data.mdb``, held in place
by a read transaction until released, expired or dropped with their owner."""

from __future__ import annotations

import mmap
import stat
from dataclasses import replace
from pathlib import Path

from kvstore.clock import FakeClock
from kvstore.config import DiskConfig
from kvstore.engine.store import Lent, ReadLease, TieredStore
from kvstore.records import parse_header
from tests.helpers import FP
from tests.test_store import C, config, put_chain


def _file_bytes(store: TieredStore, lent: Lent) -> tuple[bytes, bytes]:
    """(header bytes, payload) of a loan, read from data.mdb as another process would:
    through a read-only mapping of the file at the loan's offset."""
    path = store.disk.data_file  # type: ignore[union-attr]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        record = mm[lent.offset : lent.offset + lent.length]
    header = parse_header(record, expect_key=lent.key)
    return record[: header.header_size], record[header.header_size :]


def _restarted(tmp: Path, n: int, **kw: object) -> tuple[TieredStore, list]:  # type: ignore[type-arg]
    """A store on ``n`` chunks that are in L2 only (put, then the store reopened)."""
    with TieredStore(config(tmp, **kw)) as s:  # type: ignore[arg-type]
        chain = put_chain(s, list(range(4000, 4000 + n * C)), bpt=256)
    return TieredStore(config(tmp, **kw)), chain  # type: ignore[arg-type]


def test_lend_serves_l2_in_place_without_promoting(tmp_path: Path) -> None:
    """Chunks only in L2 are lent where they lie: the file holds their exact records at
    the offsets lent; nothing is promoted into L1; a chunk in L1 is leased there; a
    miss is None; the reads count as L2 hits; releasing ends every loan."""
    s, chain = _restarted(tmp_path, 6)
    with s:
        fresh = put_chain(s, list(range(9000, 9000 + C)), bpt=256)[0]  # in L1 (and L2)
        keys = [h.key for h, _ in chain]
        hits = s.stats().tiers[1].hits
        got = s.lend([*keys, fresh[0].key, b"\x07" * 32], owner="me")  # type: ignore[list-item]
        assert all(isinstance(g, Lent) for g in got[:6]), got
        assert isinstance(got[6], ReadLease), "a chunk in L1 is leased from L1"
        assert got[7] is None, "a miss is None, in its place"
        for (header, payload), g in zip(chain, got[:6], strict=True):
            assert isinstance(g, Lent)
            packed, body = _file_bytes(s, g)
            assert packed == g.packed and body == payload, "the file holds other bytes there"
            assert g.header.payload_checksum == header.payload_checksum
        assert all(w == (2,) for w in s.contains(keys)), "a loan must not promote into L1"
        assert s.stats().tiers[1].hits == hits + 6, "each loan is an L2 hit"
        assert s.stats().tiers[1].detail["loans"] == 6
        assert s.hold_info(got[0].id) == ("me", "lease", chain[0][0].stored_size)  # type: ignore[union-attr]
        assert all(s.release(g.id) for g in got[:7]), "every loan and lease was held"  # type: ignore[union-attr]
        assert not s.release(got[0].id), "a loan ends once"  # type: ignore[union-attr]
        assert s.stats().tiers[1].detail["loans"] == 0


def test_a_loan_keeps_its_pages_while_the_store_rewrites_the_file(tmp_path: Path) -> None:
    """The read transaction behind a loan keeps the record's pages: deleting the chunk
    and writing over 4x its bytes anew leaves what the file holds at the lent offset
    intact until the loan ends (LMDB reuses freed pages only after the last reader
    that may see them). Without the transaction, the deleted chunk's pages go to the
    next writes and the offset would show other bytes."""
    s, chain = _restarted(tmp_path, 4)
    with s:
        (g,) = s.lend([chain[0][0].key], owner="me")
        assert isinstance(g, Lent)
        for header, _ in chain:
            assert s.delete(header.key)
        put_chain(s, list(range(20_000, 20_000 + 16 * C)), bpt=256)
        s.flush()
        assert _file_bytes(s, g)[1] == chain[0][1], "a lent record changed under its loan"
        assert s.release(g.id)


def test_loans_expire_renew_and_go_with_their_owner(tmp_path: Path) -> None:
    """On the injected clock: a loan not released within lease_ms is reclaimed by
    upkeep, and its late release says False (what was read may be garbage); a renewal
    by its owner's session keeps one alive; an owner's end drops all of its loans."""
    clock = FakeClock()
    with TieredStore(config(tmp_path)) as s:
        chain = put_chain(s, list(range(5000, 5000 + 4 * C)), bpt=256)
    with TieredStore(config(tmp_path), clock=clock) as s:
        lease_s = s.config.memory.lease_ms / 1000
        keys = [h.key for h, _ in chain]
        a = s.lend(keys[:2], owner="a")
        b = s.lend(keys[2:], owner="b")
        clock.advance(lease_s * 0.8)
        assert s.renew_owner("a") == 2
        clock.advance(lease_s * 0.5)  # b's are past their expiry, a's were renewed
        assert s.upkeep() >= 2
        assert [s.release(x.id) for x in b] == [False, False], "b's loans had expired"  # type: ignore[union-attr]
        assert s.stats().tiers[1].detail["loans"] == 2
        assert s.release_owner("a") == 2
        assert s.stats().tiers[1].detail["loans"] == 0
        assert s.hold_info(a[0].id) is None  # type: ignore[union-attr]


def test_encoded_records_are_promoted_not_lent(tmp_path: Path) -> None:
    """A record L2 holds encoded (zstd) cannot be copied as it lies: it is promoted into
    L1 and leased there, as without loans, and counted as one L2 hit, not two."""
    s, chain = _restarted(tmp_path, 2)
    s.close()
    zstd = replace(config(tmp_path), disk=DiskConfig(capacity_bytes=64 << 20, codec="zstd"))
    with TieredStore(zstd) as s:
        other = put_chain(s, list(range(7000, 7000 + 2 * C)), bpt=256)
    with TieredStore(zstd) as s:
        hits = s.stats().tiers[1].hits
        got = s.lend([other[0][0].key, chain[0][0].key])
        assert isinstance(got[0], ReadLease), "an encoded record is promoted and leased"
        assert isinstance(got[1], Lent), "a raw one written before is still lent"
        assert s.stats().tiers[1].hits == hits + 2
        for g in got:
            assert g is not None and s.release(g.id)


def test_prefetch_can_leave_l2_chunks_for_loans(tmp_path: Path) -> None:
    """``prefetch(skip_disk=True)`` (a reader that takes L2's records in place) queues
    nothing for chunks in L2: promoting them would be the pass the loan saves."""
    s, chain = _restarted(tmp_path, 4)
    with s:
        keys = [h.key for h, _ in chain]
        assert s.prefetch(FP, keys, skip_disk=True) == 0
        assert s.prefetch(FP, keys) == 4


def test_only_the_servers_user_may_read_l2s_files(tmp_path: Path) -> None:
    """The records (KV and the prompts' token ids) and LMDB's reader table a loan's
    reader uses are the server's user's alone, as the arena is: a new directory is
    0700, its files 0600."""
    with TieredStore(config(tmp_path)) as s:
        put_chain(s, list(range(100, 100 + C)))
        lmdb_dir = Path(s.disk.data_file).parent  # type: ignore[union-attr]
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in lmdb_dir.iterdir()}
        assert stat.S_IMODE(lmdb_dir.stat().st_mode) == 0o700, oct(lmdb_dir.stat().st_mode)
    assert modes == dict.fromkeys(("data.mdb", "lock.mdb", "kvstore.lock"), 0o600), modes


def test_closing_the_store_ends_its_loans(tmp_path: Path) -> None:
    """A loan left open does not keep the store from closing (its transaction ends
    first); the directory reopens with every record intact."""
    s, chain = _restarted(tmp_path, 2)
    got = s.lend([h.key for h, _ in chain], owner="me")
    assert all(isinstance(g, Lent) for g in got)
    s.close()
    with TieredStore(config(tmp_path)) as again:
        assert again.get(chain[1][0].key) is not None
