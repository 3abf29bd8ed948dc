"""kill -9 of kvstore-server during heavy concurrent writes, and a restart on the same data dir.

Builds on tests/tiers/test_disk.py (kill -9 of a process writing LMDB directly) and
tests/server/test_lifecycle.py (SIGTERM under load): here the whole server dies
with SIGKILL while 6 clients write over both data planes, three times over.

What a put promises: acknowledged means stored in L1 (memory); written down means
also committed to LMDB (``exists`` reports tier 2). After each crash every chunk
that was written down must be found, byte for byte; chunks acknowledged but still
only in memory may be gone (L1 is volatile by design) and are counted apart;
nothing found may be half-written; the LMDB index must open without dropping a
damaged entry; the dead server's shared-memory arena must not be left behind.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import kvstore
from kvstore.testing.mix import Mix, MixConfig, payload_for, reconcile, wait_for
from kvstore.testing.server import KVServer
from tests.faults.conftest import arena_files

CYCLES = 3
LOAD_S = 2.0  # writes before each kill


def _verify_everything(c: kvstore.Client) -> tuple[int, int, list[str]]:
    """Read every chunk the server lists; (read, wrong, problems). First the server's
    write-downs drain: one still running may evict a listed chunk from a full L2 (by
    design) between the list and its read, which is not a lost chunk."""
    n, wrong, problems = 0, 0, []
    deadline = time.monotonic() + 60
    while (pending := c.stats().pending_writes) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pending:
        problems.append(f"{pending} write-downs still pending after 60 s")
    for view in c.list():
        got = c.get(view.key)  # the SDK checks the payload checksum of what it receives
        n += 1
        if got is None:
            problems.append(f"listed chunk {view.key.hex()[:16]} cannot be read")
        elif got[1] != payload_for(view.key, got[0].raw_size).tobytes():
            wrong += 1
            problems.append(f"chunk {view.key.hex()[:16]} holds other bytes")
    return n, wrong, problems


def test_kill9_under_concurrent_writes_loses_nothing_written_down(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    srv = make_server(
        "crash", args=["--chunk-tokens", "16", "--granularity", "4", "--log-level", "warning"]
    ).start()
    mix = Mix(
        MixConfig(
            url=[srv.unix_url, srv.tcp_url],
            clients=6,
            seconds=600,
            weights=(0.8, 0.15, 0.0, 0.05),
            tolerate_down=True,
            timeout=3.0,
            shm=lambda i: i % 2 == 0,
            seed=2,
            tag="crash",
        )
    )
    totals: dict[str, int] = {"lost": 0, "wrong": 0, "volatile": 0, "found": 0, "read": 0}
    problems: list[str] = []
    recoveries: list[float] = []
    killed = threading.Event()

    def prober() -> None:
        with kvstore.Client(srv.unix_url, shm=False, timeout=2.0) as p:
            while not mix.done:
                if not killed.is_set():
                    try:
                        mix.probe_durable(p)
                    except kvstore.errors.KVStoreError:
                        pass
                time.sleep(0.2)

    mix.start()
    probe = threading.Thread(target=prober, daemon=True)
    probe.start()
    try:
        for cycle in range(CYCLES):
            time.sleep(LOAD_S)
            with kvstore.Client(srv.unix_url, shm=False) as c:
                arena = c.info().shm_path
            durable_before = len(mix.ledger.durable)
            killed.set()
            srv.stop(signal.SIGKILL)  # in the middle of puts, write-downs and commits
            assert mix.pause(30), "client threads did not park after the kill"
            t_restart = time.monotonic()
            srv.start()
            with kvstore.Client(srv.unix_url, shm=False) as c:
                wait_for(c.health, 30, "the restarted server to serve")
                recoveries.append(time.monotonic() - t_restart)
                stats = c.stats()
                disk = next(t for t in stats.tiers if t.name == "disk")
                if disk.corrupt:
                    problems.append(f"cycle {cycle}: {disk.corrupt} damaged LMDB entries dropped")
                out = reconcile(mix.ledger, c)
                n, wrong, found_problems = _verify_everything(c)
                if n != disk.chunks:
                    problems.append(
                        f"cycle {cycle}: listed {n} chunks, the disk tier holds {disk.chunks}"
                    )
            for k in ("lost", "wrong", "volatile", "found"):
                totals[k] += out[k]
            totals["wrong"] += wrong
            totals["read"] += n
            problems += out["details"] + found_problems
            if arena and arena.rsplit("/", 1)[-1] in arena_files():
                problems.append(
                    f"cycle {cycle}: the killed server's arena {arena} is left in /dev/shm"
                )
            if durable_before == 0:
                problems.append(f"cycle {cycle}: no chunk was seen on disk before the kill")
            killed.clear()
            mix.resume()
    finally:
        mix.stop()
        tally = mix.join(30)
        probe.join(10)
    rc = srv.stop()
    record(
        "Crash",
        "kill -9 during concurrent writes",
        f"{CYCLES} x SIGKILL of the server while 6 clients write (3 shm, 3 gRPC), restart on "
        "the same data dir; every chunk listed after a restart read back and compared",
        faults=CYCLES,
        requests=tally.requests + totals["read"],
        lost=totals["lost"],
        wrong=totals["wrong"] + tally.wrong,
        recovery_s=max(recoveries, default=None),
        notes=f"{totals['found']} acknowledged chunks found again; {totals['volatile']} "
        "acknowledged but only in memory at the kill (L1 is volatile); "
        f"{totals['read']} chunks re-read; recovery = restart to serving "
        "(LMDB reopened, index rebuilt)",
    )
    assert not problems, "\n".join(problems[:20])
    assert totals["lost"] == 0 and totals["wrong"] == 0 and tally.wrong == 0, totals
    assert tally.errors == 0, "\n".join(tally.details)
    assert totals["found"] > 100, f"too few chunks survived to prove anything: {totals}"
    assert rc == 0, srv.log()
