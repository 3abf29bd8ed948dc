"""A consumer's drop (Release with drop_keys: the vLLM connector's drop_after_load) while
another client holds a lease on the same chunk, and that client is killed.

The drop must not pull the chunk from under its holder, and must not leave it stored for
ever once the holder is gone: the server deletes it from every tier when the last lease
on it ends, here when the killed holder's Session ends.
"""

from __future__ import annotations

import select
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import kvstore
from kvstore.testing.mix import wait_for
from kvstore.testing.server import KVServer, clean_env
from tests.server.helpers import chunk_header_for, memory_detail, namespace, payload, tokens
from tests.server.holder import command as holder_command

REPO = Path(__file__).resolve().parents[2]
CHUNK, BPT, TAG = 16, 65536, "faults-drop-holder"


def test_a_dropped_chunk_goes_when_its_killed_holders_session_ends(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    """A holder process stores a chunk and leases it; a consumer loads the same chunk and
    drops it: deferred, it stays readable byte for byte; the holder is killed (SIGKILL):
    once the server sees its Session end, the chunk is gone from L1 and L2 and the
    holder's pages are back."""
    srv = make_server("drops", args=["--chunk-tokens", str(CHUNK), "--log-level", "warning"])
    srv.start()
    key = chunk_header_for(namespace(TAG, BPT), tokens(CHUNK, 77), BPT, seed=1).key
    want = payload(CHUNK * BPT, 1)
    wrong = reads = 0
    with kvstore.Client(srv.unix_url, shm=True) as consumer:
        base = memory_detail(consumer)
        holder = subprocess.Popen(
            holder_command(srv.unix_url, CHUNK, BPT, TAG),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=clean_env(),
            cwd=str(REPO),
        )
        try:
            assert holder.stdout is not None
            ready, _, _ = select.select([holder.stdout], [], [], 60)
            line = holder.stdout.readline() if ready else b"(nothing in 60 s)"
            assert line.strip() == b"ready", f"holder did not start: {line!r}"
            wait_for(lambda: consumer.exists([key]) == [(1, 2)], 20.0, "the write-down to L2")
            (lease,) = consumer.acquire_many([key])
            out = np.empty_like(want)
            reads += 1
            wrong += not (lease.read_verified(out) and np.array_equal(out, want))
            r = consumer.drop([key], release=[lease])
            still = consumer.exists([key])
            got = consumer.get(key)  # the holder's chunk, read after the drop
            reads += 1
            wrong += got is None or got[1] != want.tobytes()
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            recovery, late = None, ""
            try:
                recovery = wait_for(
                    lambda: consumer.exists([key]) == [()], 10.0, "the chunk to go with its holder"
                )
                wait_for(
                    lambda: memory_detail(consumer)["pages_used"] == base["pages_used"],
                    10.0,
                    "the holder's pages to come back",
                )
            except AssertionError as e:
                late = str(e)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
        stats = consumer.stats()
    record(
        "Clients",
        "a leased chunk dropped, its holder killed",
        "a client holds a lease on a chunk (and a reservation); a consumer loads the chunk "
        "and drops it (Release with drop_keys); the holder is killed with SIGKILL",
        faults=1,
        requests=reads,
        wrong=wrong,
        recovery_s=recovery,
        notes=f"drop answered {tuple(r)}; stored after the drop: {still}; "
        f"dropped {stats.dropped}, deferred {stats.drops_deferred}{'; ' + late if late else ''}",
    )
    assert not late, late
    assert tuple(r) == (1, 0, 1), f"the holder's lease must defer the drop: {r}"
    assert still == [(1, 2)], f"a chunk another client holds was pulled: {still}"
    assert wrong == 0, "a read after the drop gave other bytes"
    assert (stats.dropped, stats.drops_deferred) == (1, 1), (stats.dropped, stats.drops_deferred)
    assert srv.stop() == 0, srv.log()
