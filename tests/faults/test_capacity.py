"""Capacity faults under concurrent writers: the disk budget, the filesystem and the arena fill up.

Builds on tests/tiers/test_disk.py (map full, ENOSPC on a 3 MiB tmpfs, one tier alone)
and tests/tiers/test_memory.py (arena eviction): here a real server takes
concurrent writers over both data planes. Expected: eviction, or back-pressure
with a clear status (FULL), never a deadlock (every call within its deadline),
a crash, or wrong bytes; after a full disk the data dir still opens and every
chunk it holds reads back byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvstore
from kvstore.keys import ROOT, Namespace, chunk_key, tokens_to_bytes
from kvstore.testing.mix import Mix, MixConfig, payload_for
from kvstore.testing.server import KVServer
from kvstore.types import PutStatus
from tests.faults.test_crash import _verify_everything

ARGS = ["--chunk-tokens", "16", "--granularity", "4", "--log-level", "error"]


def _tier(c: kvstore.Client, name: str) -> Any:
    return next(t for t in c.stats().tiers if t.name == name)


def _mix(srv: KVServer, seconds: float, seed: int, tag: str, bpt: int = 1024) -> Mix:
    return Mix(
        MixConfig(
            url=[srv.unix_url, srv.tcp_url],
            clients=8,
            seconds=seconds,
            weights=(0.6, 0.3, 0.05, 0.05),
            evictions=True,
            timeout=10.0,
            bytes_per_token=bpt,
            shm=lambda i: i % 2 == 0,
            seed=seed,
            tag=tag,
        )
    )


def test_disk_budget_full_evicts_under_concurrent_writers(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    srv = make_server("budget", args=[*ARGS, "--disk-capacity", "1MiB"], memory="1MiB").start()
    tally = _mix(srv, 5.0, 4, "budget").run()
    with kvstore.Client(srv.unix_url) as c:
        disk, mem = _tier(c, "disk"), _tier(c, "memory")
        n, wrong, problems = _verify_everything(c)
    record(
        "Capacity",
        "disk budget full",
        "8 clients x 5 s, put-heavy, into a 1 MiB arena and a 1 MiB disk budget",
        faults=disk.evictions,
        requests=tally.requests + n,
        lost=tally.lost,
        wrong=tally.wrong + wrong,
        notes=f"{mem.evictions} L1 and {disk.evictions} L2 evictions; {tally.full} puts "
        f"refused with a status; slowest call {tally.slowest:.2f} s; "
        f"disk used {disk.used_bytes} of {disk.capacity_bytes} bytes",
    )
    assert tally.errors == 0 and tally.wrong == 0 and wrong == 0, (
        f"{tally.summary()}\n" + "\n".join(tally.details + problems)
    )
    assert not problems, problems
    assert disk.evictions > 0 and mem.evictions > 0, (mem, disk)
    assert disk.used_bytes <= disk.capacity_bytes, disk
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB filesystem (tmpfs), where LMDB's writes fail with ENOSPC; needs root."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_filesystem_under_concurrent_writers(
    make_server: Callable[..., KVServer], small_fs: Path, record: Callable[..., Any]
) -> None:
    srv = make_server(
        "enospc",
        args=[*ARGS, "--disk-capacity", "64MiB"],
        memory="2MiB",
        data_dir=small_fs / "data",
    ).start()
    tally = _mix(srv, 5.0, 5, "enospc", bpt=4096).run()
    with kvstore.Client(srv.unix_url) as c:
        disk = _tier(c, "disk")
    rc = srv.stop()
    srv.start()  # the data dir must open again after the disk filled up
    with kvstore.Client(srv.unix_url) as c:
        n, wrong, problems = _verify_everything(c)
        reopened = _tier(c, "disk")
    record(
        "Capacity",
        "filesystem full (ENOSPC)",
        "8 clients x 5 s, put-heavy (64 KiB chunks), L2 on a 4 MiB tmpfs with a 64 MiB "
        "budget; then a "
        "restart and every stored chunk read back",
        faults=disk.errors,
        requests=tally.requests + n,
        lost=tally.lost,
        wrong=tally.wrong + wrong,
        notes=f"{disk.errors} disk-full write errors, {disk.evictions} evictions to make "
        f"room; {reopened.chunks} chunks on disk after the restart, {n} read back",
    )
    assert rc == 0, srv.log()
    assert tally.errors == 0 and tally.wrong == 0 and wrong == 0, (
        f"{tally.summary()}\n" + "\n".join(tally.details + problems)
    )
    assert not problems, problems
    assert disk.errors > 0, f"the filesystem never filled up: {disk}"
    assert reopened.corrupt == 0 and n == reopened.chunks > 0, reopened
    assert srv.stop() == 0, srv.log()


def test_arena_full_of_pinned_and_leased_chunks_answers_full(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    """No lower tier and every page of a 1 MiB arena pinned or leased: 8 concurrent writers
    get FULL at once (back-pressure with a clear status), and room comes back with the pages."""
    srv = make_server("arena", args=[*ARGS, "--no-disk"], memory="1MiB").start()
    ns = Namespace(model="faults-arena", dtype="bfloat16", layout="bpt1024")

    def chunk(i: int) -> tuple[list[int], Any, Any]:
        toks = list(range(i * 16, i * 16 + 16))
        key = chunk_key(ROOT, ns.fingerprint, tokens_to_bytes(toks))
        return toks, key, payload_for(key, 16 * 1024)

    with kvstore.Client(srv.unix_url, shm=True) as holder:
        pages = _tier(holder, "memory").detail["pages_total"]
        keys = []
        for i in range(pages):
            toks, key, data = chunk(i)
            _, status = holder.put_chunk(ns, ROOT, toks, data, "bfloat16", (16, 512))
            assert status == PutStatus.STORED, status
            keys.append(key)
        assert holder.pin(keys[: pages // 2]) == pages // 2
        leases = [holder.acquire(k) for k in keys[pages // 2 :]]
        assert all(leases), "every unpinned chunk must be leased"

        statuses: list[PutStatus] = []
        errors: list[str] = []
        lock = threading.Lock()

        def writer(w: int) -> None:
            with kvstore.Client(srv.unix_url if w % 2 else srv.tcp_url, timeout=5.0) as c:
                for j in range(10):
                    toks, _, data = chunk(1000 + w * 100 + j)
                    try:
                        _, st = c.put_chunk(ns, ROOT, toks, data, "bfloat16", (16, 512))
                    except kvstore.errors.KVStoreError as e:
                        with lock:
                            errors.append(f"{type(e).__name__}: {e}")
                        continue
                    with lock:
                        statuses.append(st)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        hung = sum(t.is_alive() for t in threads)
        damaged = 0
        for k in keys:  # what was pinned or leased is untouched
            got = holder.get(k)
            damaged += got is None or got[1] != payload_for(k, 16 * 1024).tobytes()
        for lease in leases:
            assert lease is not None and lease.release()
        holder.pin(keys, pinned=False)
        toks, key, data = chunk(5000)
        _, after = holder.put_chunk(ns, ROOT, toks, data, "bfloat16", (16, 512))
    full = sum(s == PutStatus.FULL for s in statuses)
    record(
        "Capacity",
        "arena full of pinned and leased chunks",
        f"{pages}-page arena, no lower tier, every page pinned or leased; 8 concurrent writers "
        "x 10 puts over both data planes; then pins and leases given back",
        faults=full,
        requests=len(statuses) + len(errors) + len(keys),
        wrong=damaged,
        notes=f"{full} puts answered FULL, {len(errors)} errors, {hung} writers hung; "
        f"put after release: {after.value}",
    )
    assert hung == 0, "a writer hung: deadlock"
    assert not errors, errors[:5]
    assert statuses and all(s == PutStatus.FULL for s in statuses), statuses
    assert after == PutStatus.STORED, f"room must come back when pages are released: {after}"
    assert damaged == 0, f"{damaged} pinned or leased chunks lost or damaged"
    assert srv.stop() == 0, srv.log()
