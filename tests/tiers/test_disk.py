"""What is special to the L2 disk tier (the shared contract suite covers the rest).

Real LMDB in tmp_path; real subprocesses for kill -9, the directory lock and a
full disk (RLIMIT_FSIZE); raw LMDB writes to damage records.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.config import DiskConfig, KiB, MiB
from kvstore.engine.tiers.disk import DiskTier
from kvstore.errors import InvalidArgument, StoreClosed, TierError
from kvstore.keys import ChunkKey, Fingerprint, Namespace
from kvstore.records import Codec, RecordHeader, encode, make_header, verify
from kvstore.types import PutStatus
from tests.helpers import FP, make_chunk

REPO = str(Path(__file__).resolve().parents[2])
CHUNK = 64 * KiB  # payload bytes of the records most tests use


def chunk(i: int, payload: int = CHUNK, fp: Fingerprint = FP) -> tuple[RecordHeader, bytes]:
    """Record i: 16 tokens, random (incompressible) bf16 payload."""
    return make_chunk(range(i * 16, i * 16 + 16), bytes_per_token=payload // 16, seed=i, fp=fp)


def kv_like(i: int, n_tokens: int = 16, width: int = 4096) -> tuple[RecordHeader, bytes]:
    """A bf16 payload shaped and scaled like attention KV (compressible exponents)."""
    f32 = (np.random.default_rng(i).standard_normal((n_tokens, width)) * 0.5).astype("<f4")
    payload = (f32.view("<u4") >> 16).astype("<u2").tobytes()  # bf16 = top half of f32
    h, _ = make_chunk(range(i * n_tokens, (i + 1) * n_tokens), bytes_per_token=2 * width)
    return make_header(
        key=h.key,
        parent=h.parent,
        fingerprint=h.fingerprint,
        token_bytes=h.token_bytes,
        dtype="bfloat16",
        shape=(n_tokens, width),
        payload=payload,
    ), payload


@pytest.fixture
def open_tier(tmp_path: Path) -> Iterator:
    """open_tier(**config) -> DiskTier in tmp_path; every tier opened is closed at the end."""
    opened: list[DiskTier] = []

    def _open(
        clock: FakeClock | None = None, map_size: int | None = None, **cfg: object
    ) -> DiskTier:
        cfg.setdefault("capacity_bytes", 1 * MiB)
        t = DiskTier(
            DiskConfig(**cfg),
            str(tmp_path),
            clock=clock or FakeClock(),  # type: ignore[arg-type]
            map_size=map_size,
        )
        opened.append(t)
        return t

    yield _open
    for t in opened:
        t.close()


def raw_payload(tier: DiskTier, key: bytes) -> bytes | None:
    out = bytearray(1 << 20)
    h = tier.get_into(ChunkKey(key), memoryview(out))
    return None if h is None else bytes(out[: h.raw_size])


def damage(tmp_path: Path, table: bytes, key: bytes, offset: int) -> None:
    """Flip one bit of a stored value with a raw LMDB write (the tier must be closed)."""
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=2, map_size=1 << 30)
    with env.begin(write=True) as txn:
        db = env.open_db(table, txn=txn)
        value = txn.get(key, db=db)
        assert value is not None, f"{key.hex()} is not in {table!r}"
        changed = bytearray(value)
        changed[offset] ^= 0x10
        txn.put(key, bytes(changed), db=db)
    env.close()


def run_child(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )


# -- codecs -------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["raw", "zstd", "zstd_shuffle"])
@pytest.mark.parametrize("put_codec", [Codec.RAW, Codec.ZSTD_SHUFFLE])
@pytest.mark.parametrize("how", ["put", "put_record"])
def test_codec_round_trip(
    open_tier, tmp_path: Path, codec: str, put_codec: Codec, how: str
) -> None:
    t = open_tier(capacity_bytes=4 * MiB, codec=codec)
    h, payload = kv_like(1)
    blob = encode(
        key=h.key,
        parent=h.parent,
        fingerprint=h.fingerprint,
        token_bytes=h.token_bytes,
        dtype=h.dtype,
        shape=h.shape,
        payload=payload,
        codec=put_codec,
    )
    ph = verify(blob)
    if how == "put":
        assert t.put(ph, memoryview(blob)[ph.header_size :]) is PutStatus.STORED
    else:  # a write-down's whole record
        assert t.put_record(ph, blob) is PutStatus.STORED
    stored = t.get(h.key)
    assert stored is not None, "a fresh put must be readable"
    sh = verify(stored)
    assert sh.codec == Codec.parse(codec), f"disk holds {sh.codec.name}, configured {codec}"
    if codec != "raw":
        assert sh.stored_size < 0.9 * h.raw_size, f"{codec} did not compress bf16 KV-like data"
    assert (sh.key, sh.token_bytes, sh.shape) == (h.key, h.token_bytes, h.shape)
    assert raw_payload(t, h.key) == payload, "get_into must return the original raw payload"
    t.close()
    t2 = open_tier(codec="raw")  # a reopen with another codec still reads the old records
    assert raw_payload(t2, h.key) == payload, f"{codec} record unreadable after reopen"


def test_a_whole_record_in_the_disk_codec_is_stored_as_it_is(
    open_tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write-down's record (put_record) in L2's codec goes into LMDB as given, not built
    again (``_encode`` zero-fills and copies every record once more): get returns those
    very bytes; a record whose size is not its header's is refused."""
    t = open_tier(capacity_bytes=4 * MiB)

    def whole(i: int) -> tuple[RecordHeader, bytes]:
        h, payload = kv_like(i)
        blob = encode(key=h.key, parent=h.parent, fingerprint=h.fingerprint,
                      token_bytes=h.token_bytes, dtype=h.dtype, shape=h.shape,
                      payload=payload)  # fmt: skip
        return verify(blob), blob

    def rebuilt(*_: object) -> bytes:
        raise AssertionError("put_record built again a record it was given whole")

    monkeypatch.setattr(t, "_encode", rebuilt)
    ph, blob = whole(2)
    assert t.put_record(ph, blob) is PutStatus.STORED
    assert t.get(ph.key) == blob, "L2 must hold the record's own bytes"
    assert t.put_record(ph, blob) is PutStatus.EXISTS
    h3, blob3 = whole(3)
    with pytest.raises(InvalidArgument, match="its header says"):
        t.put_record(h3, blob3[:-1])
    assert t.get(h3.key) is None, "a refused record must not be stored"


# -- capacity and LRU -----------------------------------------------------------


def test_lru_eviction_order_and_on_evict(open_tier) -> None:
    clock = FakeClock()
    t = open_tier(clock=clock)
    evicted: list[tuple[bytes, RecordHeader, bytes]] = []
    t.on_evict = lambda k, h, read: evicted.append((k, h, read()))
    chunks = [chunk(i) for i in range(20)]
    per = chunks[0][0].record_size
    fit = (1 * MiB) // per
    for h, p in chunks[:fit]:
        assert t.put(h, p) is PutStatus.STORED
        clock.advance(1)
    assert t.stats().evictions == 0 and not evicted, "nothing may be evicted below capacity"
    for i in (0, 2):  # touch 0 and 2: 1 and 3 become the least recently used
        assert t.get(chunks[i][0].key) is not None
    assert t.put(*chunks[fit]) is PutStatus.STORED
    assert t.put(*chunks[fit + 1]) is PutStatus.STORED
    order = [k for k, _, _ in evicted]
    assert order == [chunks[1][0].key, chunks[3][0].key], "eviction must follow LRU order"
    for k, h, b in evicted:
        assert verify(b, expect_key=k) == h, "on_evict must get the whole verified record"
    assert t.contains([chunks[1][0].key, chunks[0][0].key]) == [False, True]
    s = t.stats()
    assert s.evictions == 2 and s.used_bytes == fit * per <= s.capacity_bytes, s


def test_pinned_never_evicted_full_and_too_large(open_tier) -> None:
    t = open_tier()
    evicted: list[bytes] = []
    t.on_evict = lambda k, h, b: evicted.append(k)
    chunks = [chunk(i) for i in range(20)]
    fit = (1 * MiB) // chunks[0][0].record_size
    for h, p in chunks[:fit]:
        assert t.put(h, p) is PutStatus.STORED
        assert t.pin(h.key)
    assert t.put(*chunks[fit]) is PutStatus.FULL, "all pinned: no room can be made"
    assert not evicted and t.stats().chunks == fit, "a FULL put must not evict anything"
    assert t.pin(chunks[5][0].key, False)
    assert t.put(*chunks[fit]) is PutStatus.STORED
    assert evicted == [chunks[5][0].key], "only the unpinned chunk may go"
    assert not t.pin(chunks[5][0].key), "pin of an absent key is False"
    big = chunk(100, payload=1 * MiB)
    assert t.put(*big) is PutStatus.TOO_LARGE
    assert t.stats().rejected == 2, t.stats()


def test_map_full_evicts_more_then_full(open_tier) -> None:
    """LMDB's map smaller than the capacity: MapFullError makes the tier evict more."""
    t = open_tier(capacity_bytes=64 * MiB, map_size=2 * MiB)
    evicted: list[bytes] = []
    t.on_evict = lambda k, h, b: evicted.append(k)
    chunks = [chunk(i, payload=128 * KiB) for i in range(40)]
    for h, p in chunks:
        assert t.put(h, p) is PutStatus.STORED, "MapFullError must turn into evictions"
    assert evicted, "the map cannot hold 40 x 128 KiB: something must have been evicted"
    present = t.contains([h.key for h, _ in chunks])
    assert present[-1] and not present[0], present
    assert sum(present) + len(evicted) == len(chunks), "every chunk is here or handed over"
    for h, _ in chunks:
        if t.contains([h.key])[0]:
            t.pin(h.key)
    assert t.put(*chunk(99, payload=512 * KiB)) is PutStatus.FULL


def test_readers_run_while_on_evict_does(open_tier) -> None:
    """on_evict runs under the writer lock only: reads from other threads proceed."""
    t = open_tier()
    chunks = [chunk(i) for i in range(20)]
    fit = (1 * MiB) // chunks[0][0].record_size
    for h, p in chunks[:fit]:
        t.put(h, p)
    seen: list[object] = []

    def reader() -> None:
        seen.append(t.get(chunks[fit - 1][0].key))
        seen.append(t.contains([chunks[fit - 1][0].key]))
        seen.append(t.stats().chunks)

    def on_evict(k: bytes, h: RecordHeader, read: Callable[[], bytes | None]) -> None:
        th = threading.Thread(target=reader)
        th.start()
        th.join(10)
        assert not th.is_alive(), "a reader blocked while on_evict ran"

    t.on_evict = on_evict
    assert t.put(*chunks[fit]) is PutStatus.STORED
    assert seen[0] is not None and seen[1] == [True] and seen[2] == fit, seen


def test_concurrent_puts_and_gets_keep_accounting(open_tier) -> None:
    t = open_tier()
    moved: list[bytes] = []
    t.on_evict = lambda k, h, b: moved.append(k)
    chunks = [chunk(i, payload=32 * KiB) for i in range(80)]
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                h, p = chunks[rng.randrange(len(chunks))]
                if rng.random() < 0.5:
                    assert t.put(h, p).ok
                elif (blob := t.get(h.key)) is not None:
                    assert verify(blob, expect_key=h.key) == h
        except BaseException as e:  # reported below with the thread's seed
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not failures, failures
    s = t.stats()
    assert s.corrupt == 0 and moved and s.evictions == len(moved), s
    assert s.used_bytes == sum(i.size for i in t.scan()) <= s.capacity_bytes, s


# -- persistence ------------------------------------------------------------------


def test_reopen_finds_everything_and_lru_survives_close(open_tier) -> None:
    clock = FakeClock()
    t = open_tier(clock=clock)
    chunks = [chunk(i) for i in range(8)]
    for h, p in chunks:
        assert t.put(h, p) is PutStatus.STORED
        clock.advance(1)
    for i in (0, 4, 0, 6):
        assert t.get(chunks[i][0].key) is not None
        clock.advance(1)
    t.pin(chunks[1][0].key)
    before = {i.key: i for i in t.scan()}
    assert t.stats().detail["dirty_access"] == 3, "reads keep access info in memory"
    t.close()
    with pytest.raises(StoreClosed):
        t.get(chunks[0][0].key)
    assert not t.stats().healthy, "stats works after close, and says the tier is down"
    t2 = open_tier(clock=FakeClock())
    after = {i.key: i for i in t2.scan()}
    assert after == before, "scan after reopen must match (headers, pins, hits, access times)"
    assert after[chunks[0][0].key].hits == 2
    evicted: list[bytes] = []
    t2.on_evict = lambda k, h, b: evicted.append(k)
    fit = (1 * MiB) // chunks[0][0].record_size
    for i in range(100, 100 + fit - 8 + 4):
        t2.put(*chunk(i))
    # LRU order before close: 1 2 3 5 7 4 0 6, and 1 is pinned
    assert evicted == [chunks[i][0].key for i in (2, 3, 5, 7)], [e.hex()[:8] for e in evicted]
    for i in (0, 1, 4, 6):
        h, p = chunks[i]
        assert raw_payload(t2, h.key) == p, f"chunk {i} lost across close"


def test_reads_do_not_write_until_flush(open_tier) -> None:
    t = open_tier()
    h, p = chunk(1)
    t.put(h, p)
    txn = t.stats().detail["last_txnid"]
    for _ in range(5):
        assert t.get(h.key) is not None
    assert t.stats().detail["last_txnid"] == txn, "a get must not start a write transaction"
    assert t.flush() == 1 and t.flush() == 0
    assert t.stats().detail["last_txnid"] == txn + 1, "flush writes back in one transaction"


KILL_CHILD = """
    import sys
    from kvstore.config import DiskConfig, MiB
    from kvstore.engine.tiers.disk import DiskTier
    from tests.tiers.test_disk import chunk
    t = DiskTier(DiskConfig(capacity_bytes=256 * MiB), sys.argv[1])
    for i in range(int(sys.argv[2]), 100000):
        h, p = chunk(i, payload=256 * 1024)
        t.put(h, p)
        print("committed", i, flush=True)
"""


def test_kill9_loses_nothing_committed(tmp_path: Path) -> None:
    """kill -9 at a random point while puts run: every put that returned is there,
    byte-exact; the one in flight is wholly there or absent; nothing reads as corrupt."""
    rng = np.random.default_rng()
    start = 0
    for round_ in range(3):
        proc = run_child(KILL_CHILD, str(tmp_path), str(start))
        stop_after = int(rng.integers(2, 20))
        printed: list[int] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                printed.append(int(line.split()[1]))
                if printed[-1] >= start + stop_after:
                    break
            proc.send_signal(signal.SIGKILL)  # the child is in the middle of its next put
            proc.wait()
            printed += [int(line.split()[1]) for line in proc.stdout.read().splitlines()]
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        assert printed, f"child died early: {proc.stderr.read() if proc.stderr else ''}"
        committed = max(printed)
        t = DiskTier(DiskConfig(capacity_bytes=256 * MiB), str(tmp_path))
        try:
            present = t.stats().chunks
            assert present in (committed + 1, committed + 2), (
                f"round {round_}: {present} chunks after the last committed put #{committed}"
            )
            for i in range(present):  # the first present ones, in put order
                h, p = chunk(i, payload=256 * KiB)
                assert raw_payload(t, h.key) == p, f"round {round_}: committed chunk {i} lost"
            assert t.stats().corrupt == 0, t.stats()
        finally:
            t.close()
        start = present


# -- damage -----------------------------------------------------------------------


@pytest.mark.parametrize("offset", [10, -100], ids=["header", "payload"])
def test_corrupt_value_is_a_counted_miss(open_tier, tmp_path: Path, offset: int) -> None:
    t = open_tier()
    (h, p), (h2, p2) = chunk(1), chunk(2)
    t.put(h, p)
    t.put(h2, p2)
    t.close()
    damage(tmp_path, b"records", h.key, offset)
    t = open_tier()
    reported: list[bytes] = []
    t.on_corrupt = reported.append
    assert t.contains([h.key]) == [True], "contains does not verify"
    assert t.get(h.key) is None, "a damaged record must be a miss"
    assert reported == [h.key], "the store must be told through on_corrupt"
    s = t.stats()
    assert (s.corrupt, s.misses, s.chunks) == (1, 1, 1), s
    assert t.contains([h.key]) == [False], "the damaged record and its meta must be deleted"
    assert [i.key for i in t.scan()] == [h2.key]
    assert raw_payload(t, h2.key) == p2, "its neighbour must be untouched"


def test_damaged_meta_is_dropped_at_open(open_tier, tmp_path: Path) -> None:
    t = open_tier()
    (h, p), (h2, p2) = chunk(1), chunk(2)
    t.put(h, p)
    t.put(h2, p2)
    t.close()
    damage(tmp_path, b"meta", h.key, 50)
    t = open_tier()
    assert t.stats().corrupt == 1 and t.contains([h.key, h2.key]) == [False, True]
    assert t.stats().used_bytes == h2.record_size, "the dropped record's bytes are freed"


def test_garbage_data_file_gives_a_clear_error(open_tier, tmp_path: Path) -> None:
    t = open_tier()
    t.put(*chunk(1))
    t.close()
    data = tmp_path / "lmdb" / "data.mdb"
    with open(data, "r+b") as f:
        f.write(np.random.default_rng(0).integers(0, 256, 64 * KiB, dtype=np.uint8).tobytes())
    with pytest.raises(TierError) as err:
        DiskTier(DiskConfig(capacity_bytes=1 * MiB), str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path / "lmdb") in msg and "move the directory aside" in msg, msg
    assert isinstance(err.value.__cause__, lmdb.Error), "the LMDB error must be chained"
    os.rename(tmp_path / "lmdb", tmp_path / "lmdb.broken")  # what the message says to do
    t = open_tier()
    assert t.stats().chunks == 0, "a failed open must not keep the directory locked"


def test_scan_reads_meta_only(open_tier, tmp_path: Path) -> None:
    t = open_tier()
    chunks = [chunk(i) for i in range(5)]
    for h, p in chunks:
        t.put(h, p)
    t.close()
    # replace every record by garbage: scan must not notice
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=2, map_size=1 << 30)
    with env.begin(write=True) as txn:
        db = env.open_db(b"records", txn=txn)
        for h, _ in chunks:
            txn.put(h.key, b"garbage", db=db)
    env.close()
    t = open_tier()
    infos = {i.key: i for i in t.scan()}
    assert set(infos) == {h.key for h, _ in chunks}
    for h, _ in chunks:
        assert infos[h.key].header == h and infos[h.key].size == h.record_size
    assert t.stats().corrupt == 0, "neither open nor scan may read the records"
    assert t.get(chunks[0][0].key) is None and t.stats().corrupt == 1


def test_scan_delete_and_clear_by_fingerprint(open_tier) -> None:
    t = open_tier()
    other = Namespace(model="other").fingerprint
    mine = [chunk(i) for i in range(3)]
    theirs = [chunk(i, fp=other) for i in range(3, 5)]
    for h, p in mine + theirs:
        t.put(h, p)
    assert {i.key for i in t.scan(other)} == {h.key for h, _ in theirs}
    assert t.delete(mine[0][0].key) and not t.delete(mine[0][0].key)
    assert t.clear(other) == 2
    assert t.contains([h.key for h, _ in mine + theirs]) == [False, True, True, False, False]
    assert t.clear() == 2 and t.stats().used_bytes == 0 and list(t.scan()) == []


# -- processes and the disk ----------------------------------------------------------

HOLD_CHILD = """
    import sys
    from kvstore.config import DiskConfig, MiB
    from kvstore.engine.tiers.disk import DiskTier
    t = DiskTier(DiskConfig(capacity_bytes=MiB), sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()
    t.close()
"""


def test_second_process_is_refused(tmp_path: Path) -> None:
    proc = run_child(HOLD_CHILD, str(tmp_path))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", (
            proc.stderr.read() if proc.stderr else ""
        )
        refused = rf"in use by another kvstore process \(pid {proc.pid}\)"
        with pytest.raises(TierError, match=refused):
            DiskTier(DiskConfig(capacity_bytes=1 * MiB), str(tmp_path))
    finally:
        proc.communicate("\n", timeout=30)
    t = DiskTier(DiskConfig(capacity_bytes=1 * MiB), str(tmp_path))
    t.close()


FULL_CHILD = """
    import resource, signal, sys
    from kvstore.config import DiskConfig, MiB
    from kvstore.errors import TierError
    from kvstore.engine.tiers.disk import DiskTier
    from tests.tiers.test_disk import chunk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    t = DiskTier(DiskConfig(capacity_bytes=64 * MiB), sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * MiB, 2 * MiB))
    for i in range(30):
        try:
            print(i, t.put(*chunk(i, payload=256 * 1024)).name, flush=True)
        except TierError as e:
            print(i, "TierError", e, flush=True)
    t.close()
"""


def test_full_disk_keeps_what_was_committed(tmp_path: Path) -> None:
    proc = run_child(FULL_CHILD, str(tmp_path))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    outcomes = [line.split(None, 2) for line in out.splitlines()]
    stored = [int(i) for i, what, *_ in outcomes if what == "STORED"]
    failed = [what for _, what, *_ in outcomes if what != "STORED"]
    assert stored and failed, f"the 2 MiB file limit must stop some puts: {out}"
    assert set(failed) <= {"FULL", "TierError"}, out
    t = DiskTier(DiskConfig(capacity_bytes=64 * MiB), str(tmp_path))
    try:
        assert t.stats().chunks == len(stored)
        for i in stored:
            h, p = chunk(i, payload=256 * KiB)
            assert raw_payload(t, h.key) == p, f"committed chunk {i} damaged by the full disk"
        assert t.stats().corrupt == 0
    finally:
        t.close()


def test_durability_modes(open_tier) -> None:
    t = open_tier(durability="fsync")
    flags = t._env.flags()
    assert flags["sync"] and flags["metasync"] and not flags["writemap"], flags
    t.close()
    t = open_tier(durability="process")
    flags = t._env.flags()
    assert not flags["sync"] and not flags["writemap"], flags
    s = t.stats()
    assert s.detail["map_size"] >= 2 * s.capacity_bytes and s.detail["file_size"] > 0, s.detail


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 3 MiB filesystem (tmpfs), where writes fail with ENOSPC; needs root."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_evicts_then_full_and_keeps_committed(small_fs: Path) -> None:
    cfg = DiskConfig(capacity_bytes=64 * MiB)  # the filesystem, not the capacity, is the limit
    t = DiskTier(cfg, str(small_fs))
    try:
        evicted: list[bytes] = []
        t.on_evict = lambda k, h, b: evicted.append(k)
        chunks = [chunk(i, payload=256 * KiB) for i in range(20)]
        for h, p in chunks:
            assert t.put(h, p) is PutStatus.STORED, "a full filesystem must first cost evictions"
        assert evicted and t.stats().errors > 0, "20 x 256 KiB cannot fit in 3 MiB"
        kept = [(h, p) for h, p in chunks if t.contains([h.key])[0]]
        n_evicted = len(evicted)
        status = PutStatus.STORED
        for i in range(100, 120):  # everything pinned: fill the pages the evictions freed
            for h, _ in kept:
                t.pin(h.key)
            status = t.put(*chunk(i, payload=256 * KiB))
            if status is not PutStatus.STORED:
                break
            kept.append(chunk(i, payload=256 * KiB))
        assert status is PutStatus.FULL, f"ENOSPC with nothing evictable must be FULL: {status}"
        assert len(evicted) == n_evicted, "pinned chunks must not be evicted"
        assert not t.stats().healthy and "disk full" in str(t.stats().detail["last_error"])
    finally:
        t.close()
    t = DiskTier(cfg, str(small_fs))
    try:
        assert t.stats().chunks == len(kept)
        for h, p in kept:
            assert raw_payload(t, h.key) == p, "ENOSPC must not damage committed chunks"
    finally:
        t.close()
