"""Leases of the shared-memory data plane: a dead client cannot leak arena pages."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

import kvstore
from kvstore.errors import NotFound
from kvstore.keys import ROOT
from kvstore.sdk import client_core as core
from kvstore.testing.server import KVServer, clean_env
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.server import holder
from tests.server.helpers import memory_detail, namespace, payload, shape_for, tokens


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_killed_client_leaks_no_pages(make_server: Callable[..., KVServer]) -> None:
    # A server of its own: holds other tests leave on the shared one expire on their own
    # clock and would move the counts this test compares.
    server = make_server("leaks").start()
    with kvstore.Client(server.unix_url, shm=True) as c:
        before = memory_detail(c)
        proc = subprocess.Popen(
            holder.command(server.unix_url, 256, 4096, "holder"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=clean_env(),
            cwd=str(_repo_root()),
        )
        try:
            line = proc.stdout.readline() if proc.stdout else b""
            assert line.strip() == b"ready", (
                f"holder did not start: {line!r} {proc.stderr.read() if proc.stderr else b''!r}"
            )
            held = memory_detail(c)
            assert held["active_leases"] >= before["active_leases"] + 1, held
            assert held["reservations"] >= before["reservations"] + 1, held
            # The stored chunk (16 pages of 64 KiB + a header page) plus the reservation.
            assert held["pages_used"] > before["pages_used"] + 17, (before, held)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

        # lease_ms is 30 s: only the end of the Session stream can free these now.
        _wait_for(
            lambda: (
                memory_detail(c)["active_leases"] == before["active_leases"]
                and memory_detail(c)["reservations"] == before["reservations"]
            ),
            15.0,  # the Session's end is seen when the socket closes; a loaded machine is slow
            "the killed client's lease and reservation to be dropped",
        )
        after = memory_detail(c)
        stored_pages = -(-(256 * 4096 + 4096) // after["page_bytes"])  # the committed chunk
        assert after["pages_used"] == before["pages_used"] + stored_pages, (before, after)
        assert after["deleted_while_leased"] == before["deleted_while_leased"]


def test_closed_client_drops_its_leases(server: KVServer) -> None:
    with kvstore.Client(server.unix_url) as watcher:
        base = memory_detail(watcher)["active_leases"]
        c = kvstore.Client(server.unix_url, shm=True)
        ns = namespace("closer", 4096)
        key, _ = c.put_chunk(
            ns, ROOT, tokens(16, 5), payload(16 * 4096, 4), "bfloat16", shape_for(16, 4096)
        )
        leases = [c.acquire(key) for _ in range(3)]
        assert all(leases) and memory_detail(watcher)["active_leases"] == base + 3
        c.close()  # ends the Session without releasing
        _wait_for(
            lambda: memory_detail(watcher)["active_leases"] == base,
            5.0,
            "leases of a closed client to be dropped",
        )


def test_leases_are_per_session(server: KVServer) -> None:
    with (
        kvstore.Client(server.unix_url, shm=True) as a,
        kvstore.Client(server.unix_url, shm=True) as b,
    ):
        ns = namespace("per-session", 4096)
        key, _ = a.put_chunk(
            ns, ROOT, tokens(16, 6), payload(16 * 4096, 8), "bfloat16", shape_for(16, 4096)
        )
        lease = a.acquire(key)
        assert lease is not None
        release = pb.ReleaseRequest(lease_ids=[lease.id])
        with pytest.raises(NotFound, match="unknown lease"):
            b._run(core.rpc("Release", release, None))  # another session's lease
        assert lease.release() is True
        with pytest.raises(NotFound, match="unknown lease"):
            a._run(core.rpc("Release", release, None))  # released twice
        assert a._run(core.release(lease.id, None)) is False, (
            "a gone lease means: discard what was read"
        )
        stub = pb_grpc.KVStoreStub(a._channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Commit(pb.CommitRequest(reservation_id=987654321), metadata=a._metadata)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value
        assert "unknown reservation" in (e.value.details() or "")


def _repo_root() -> Any:
    from pathlib import Path

    return Path(__file__).resolve().parents[2]
