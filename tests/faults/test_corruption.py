"""Flipped bits in every tier: each read verifies, reports a miss, deletes the record, counts it.

Builds on the tier tests (tests/tiers: corrupt LMDB values, Redis values, arena
records, one tier at a time) and the connector's corrupt-record fault: here the
bits are flipped under a running (or restarted) kvstore-server and read through
the SDK over both data planes. Wrong bytes must never reach a client.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

import kvstore
from kvstore.keys import ROOT, ChunkKey, Namespace, chunk_key, tokens_to_bytes
from kvstore.testing.mix import payload_for
from kvstore.testing.redis import RedisServer, available
from kvstore.testing.server import KVServer

ARGS = ["--chunk-tokens", "16", "--granularity", "4", "--log-level", "error"]
N = 24  # chunks per scenario; a third of them damaged


def _put_chunks(c: kvstore.Client, tag: str, n: int = N) -> list[ChunkKey]:
    ns = Namespace(model="faults-corrupt", dtype="bfloat16", layout=tag)
    keys = []
    for i in range(n):
        toks = list(range(i * 16 + 1, i * 16 + 17))
        key = chunk_key(ROOT, ns.fingerprint, tokens_to_bytes(toks))
        got, status = c.put_chunk(
            ns, ROOT, toks, payload_for(key, 16 * 1024), "bfloat16", (16, 512)
        )
        assert status.ok and got == key, status
        keys.append(key)
    return keys


def _offsets(rng: np.random.Generator, size: int) -> list[int]:
    """Where to flip: the magic, the header, the token ids, the payload, the last byte."""
    return [
        0,
        int(rng.integers(8, 64)),
        int(rng.integers(64, 128)),
        int(rng.integers(256, size - 1)),
        size - 1,
    ]


def _read_all(c: kvstore.Client, keys: list[ChunkKey], damaged: set[ChunkKey]) -> dict[str, int]:
    """Read every key: damaged ones must be misses (or the good copy of a lower tier),
    intact ones byte-exact; count what was served wrong and what was lost."""
    out = {"reads": 0, "wrong": 0, "lost": 0, "misses": 0}
    for key in keys:
        for _ in range(2):  # the second read must not find the damaged record either
            got = c.get(key)
            out["reads"] += 1
            if got is None:
                out["misses"] += 1
                out["lost"] += key not in damaged
            elif got[1] != payload_for(key, 16 * 1024).tobytes():
                out["wrong"] += 1
    return out


def _tier(c: kvstore.Client, name: str) -> Any:
    return next(t for t in c.stats().tiers if t.name == name)


def test_flipped_bits_in_lmdb_records(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    srv = make_server("lmdb", args=ARGS).start()
    with kvstore.Client(srv.unix_url) as c:
        keys = _put_chunks(c, "lmdb")
    assert srv.stop() == 0  # flushes every write-down
    rng = np.random.default_rng(7)
    env = lmdb.open(str(srv.data_dir / "lmdb"), max_dbs=4)
    damaged: set[ChunkKey] = set()
    flips = 0
    with env.begin(write=True) as txn:
        records, meta = env.open_db(b"records", txn=txn), env.open_db(b"meta", txn=txn)
        for i, key in enumerate(keys[: N // 3]):
            db = meta if i % 4 == 3 else records  # a few index (meta) entries too
            value = bytearray(txn.get(key, db=db) or b"")
            off = _offsets(rng, len(value))[i % 5]
            value[off] ^= 1 << int(rng.integers(0, 8))
            txn.put(key, bytes(value), db=db)
            damaged.add(key)
            flips += 1
    env.close()
    srv.start()
    with kvstore.Client(srv.unix_url) as shm_c, kvstore.Client(srv.tcp_url, shm=False) as grpc_c:
        out = _read_all(shm_c, keys[: N // 2], damaged)
        out2 = _read_all(grpc_c, keys[N // 2 :] + keys[: N // 3], damaged)
        disk = _tier(shm_c, "disk")
        left = [k for k, t in zip(keys, shm_c.exists(keys), strict=True) if k in damaged and t]
    wrong, lost = out["wrong"] + out2["wrong"], out["lost"] + out2["lost"]
    record(
        "Corruption",
        "bits flipped in LMDB",
        f"{flips} single-bit flips in L2 records and index entries (magic, header, token ids, "
        "payload, last byte) with the server stopped; restart; every chunk read twice over "
        "shm and gRPC",
        faults=flips,
        requests=out["reads"] + out2["reads"],
        lost=lost,
        wrong=wrong,
        notes=f"disk tier counted {disk.corrupt} corrupt; {len(left)} damaged records left",
    )
    assert wrong == 0 and lost == 0, (out, out2)
    assert disk.corrupt == flips, f"each damaged record is counted once: {disk.corrupt} of {flips}"
    assert not left, f"damaged records must be deleted: {len(left)} still there"
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("lower", [False, True], ids=["no-disk", "with-disk"])
def test_flipped_bits_in_the_arena(
    make_server: Callable[..., KVServer], lower: bool, record: Callable[..., Any]
) -> None:
    """Bytes of L1 records changed behind the server's back (a rogue writer on the host)."""
    srv = make_server("arena", args=[*ARGS, *([] if lower else ["--no-disk"])]).start()
    rng = np.random.default_rng(8)
    damaged: set[ChunkKey] = set()
    with kvstore.Client(srv.unix_url, shm=True) as c:
        keys = _put_chunks(c, f"arena-{lower}")
        if lower:  # write-through: the disk holds good copies
            assert _wait_written_down(c, keys)
        path = c.info().shm_path
        fd = os.open(path, os.O_RDWR)
        try:
            for i, key in enumerate(keys[: N // 3]):
                lease = c.acquire(key)
                assert lease is not None
                extents, start = lease._extents, lease._offset
                lease.release()
                size = start + lease.header.raw_size
                off = _offsets(rng, size)[i % 5]
                for ext_off, ext_len in extents:  # the extent holding record byte `off`
                    if off < ext_len:
                        b = os.pread(fd, 1, ext_off + off)
                        os.pwrite(fd, bytes([b[0] ^ (1 << int(rng.integers(0, 8)))]), ext_off + off)
                        break
                    off -= ext_len
                damaged.add(key)
        finally:
            os.close(fd)
        out = _read_all(c, keys, damaged)
        with kvstore.Client(srv.tcp_url, shm=False) as g:
            out2 = _read_all(g, keys, damaged)
        mem = _tier(c, "memory")
    wrong = out["wrong"] + out2["wrong"]
    lost = out["lost"] + out2["lost"]
    record(
        "Corruption",
        f"bits flipped in the arena ({'with' if lower else 'no'} L2)",
        f"{len(damaged)} single-bit flips in L1 records (header and payload) of a running "
        "server, written into the shared-memory file; every chunk read twice over shm and "
        f"gRPC{'; the good copies on disk are served instead' if lower else ''}",
        faults=len(damaged),
        requests=out["reads"] + out2["reads"],
        lost=lost,
        wrong=wrong,
        notes=f"memory tier counted {mem.corrupt} corrupt; {out['misses'] + out2['misses']} misses",
    )
    assert wrong == 0 and lost == 0, (out, out2)
    assert mem.corrupt == len(damaged), f"memory corrupt {mem.corrupt} of {len(damaged)}"
    if lower:
        assert out["misses"] + out2["misses"] == 0, "L2 holds good copies: no miss"
    else:
        assert out["misses"] + out2["misses"] == 4 * len(damaged), (out, out2)
    assert srv.stop() == 0, srv.log()


def _wait_written_down(c: kvstore.Client, keys: list[ChunkKey]) -> bool:
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(2 in t for t in c.exists(keys)):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("flavor", ["redis", "valkey"])
def test_flipped_bits_in_remote_values(
    make_server: Callable[..., KVServer], tmp_path: Path, record: Callable[..., Any], flavor: str
) -> None:
    """Host A writes through to Redis/Valkey; values are damaged there; host B (its own
    L1/L2, the same remote) reads them."""
    if not available(flavor):
        pytest.skip(f"{flavor}-server is not installed")
    import redis

    with RedisServer(flavor) as remote:
        config = tmp_path / "remote.toml"
        config.write_text(f'[remote]\nurl = "{remote.url}"\n')
        a = make_server("a", args=[*ARGS, "--config", str(config)]).start()
        b = make_server("b", args=[*ARGS, "--config", str(config)]).start()
        with kvstore.Client(a.unix_url) as ca:
            keys = _put_chunks(ca, "remote")
            ca_ok = all(3 in t for t in _until_remote(ca, keys))
        assert ca_ok, "chunks never reached the remote"
        rng = np.random.default_rng(9)
        r = redis.Redis(port=remote.port)  # both speak the same protocol
        damaged: set[ChunkKey] = set()
        for i, key in enumerate(keys[: N // 3]):
            name = f"kvs:c:{key.hex()}"
            size = int(r.strlen(name))
            off = _offsets(rng, size)[i % 5]
            byte: bytes = r.getrange(name, off, off)  # type: ignore[assignment]
            r.setrange(name, off, bytes([byte[0] ^ (1 << int(rng.integers(0, 8)))]))
            damaged.add(key)
        with kvstore.Client(b.unix_url) as cb, kvstore.Client(b.tcp_url, shm=False) as gb:
            out = _read_all(cb, keys[: N // 2], damaged)
            out2 = _read_all(gb, keys[N // 2 :], damaged)
            rem = _tier(cb, "remote")
        gone = [k for k in damaged if r.exists(f"kvs:c:{k.hex()}")]
        r.close()
        wrong, lost = out["wrong"] + out2["wrong"], out["lost"] + out2["lost"]
        record(
            "Corruption",
            f"bits flipped in {flavor} values",
            f"{len(damaged)} single-bit flips in remote records (header, token ids, "
            "compressed payload); a second server sharing the remote reads every chunk "
            "twice over shm and gRPC",
            faults=len(damaged),
            requests=out["reads"] + out2["reads"],
            lost=lost,
            wrong=wrong,
            notes=f"remote tier counted {rem.corrupt} corrupt; {len(gone)} damaged values "
            f"left in {flavor}",
        )
        assert wrong == 0 and lost == 0, (out, out2)
        assert rem.corrupt == len(damaged), f"remote corrupt {rem.corrupt} of {len(damaged)}"
        assert not gone, f"damaged remote values must be deleted: {len(gone)} left"
        assert a.stop() == 0 and b.stop() == 0


def _until_remote(c: kvstore.Client, keys: list[ChunkKey]) -> list[tuple[int, ...]]:
    import time

    deadline = time.monotonic() + 10
    found = c.exists(keys)
    while time.monotonic() < deadline and not all(3 in t for t in found):
        time.sleep(0.05)
        found = c.exists(keys)
    return found
