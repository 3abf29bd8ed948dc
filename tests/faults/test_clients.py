"""Clients under load and clients that misbehave: 16 at once, killed ones, silent ones.

Builds on tests/server/test_leases.py (a killed client's leases are dropped) by
doing it in the middle of a 16-client mix, and adds clients that connect (or
open a stream) and then send nothing.
"""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

import kvstore
from kvstore.keys import ROOT
from kvstore.testing.mix import Mix, MixConfig, wait_for
from kvstore.testing.server import KVServer, clean_env
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.server.helpers import memory_detail
from tests.server.holder import command as holder_command

REPO = Path(__file__).resolve().parents[2]
MIX_SECONDS = 12.0
SERVER_ARGS = ["--chunk-tokens", "16", "--granularity", "4", "--log-level", "warning"]


def test_sixteen_clients_mix_byte_exact_while_clients_die(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    """16 clients (8 shared memory over the Unix socket, 8 streaming over TCP) mix put, get,
    lookup and delete for a bounded time; every read is checked byte for byte. Meanwhile
    lease-holding clients are killed with SIGKILL: their leases must be dropped."""
    srv = make_server("mix", args=SERVER_ARGS).start()
    mix = Mix(
        MixConfig(
            url=[srv.unix_url, srv.tcp_url],
            clients=16,
            seconds=MIX_SECONDS,
            shm=lambda i: i % 2 == 0,
            seed=1,
            tag="clients",
        )
    )
    kills, t0 = 0, time.monotonic()
    with kvstore.Client(srv.unix_url, shm=True) as watcher:
        base = memory_detail(watcher)
        mix.start()
        while time.monotonic() - t0 < MIX_SECONDS - 4 and kills < 3:
            holder = subprocess.Popen(
                holder_command(srv.unix_url, 16, 65536, "faults-holder"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=clean_env(),
                cwd=str(REPO),
            )
            try:
                assert holder.stdout is not None
                ready, _, _ = select.select([holder.stdout], [], [], 60)
                line = holder.stdout.readline() if ready else b"(nothing in 60 s)"
                if line.strip() != b"ready":
                    holder.kill()
                    raise AssertionError(
                        f"holder did not start: {line!r} "
                        f"{holder.communicate(timeout=10)[0][-2000:]!r}"
                    )
                holder.send_signal(signal.SIGKILL)
                holder.wait(10)
                kills += 1
            finally:
                if holder.poll() is None:
                    holder.kill()
                    holder.wait()
        tally = mix.join(MIX_SECONDS + 60)

        # Every lease and reservation of the killed holders (and of the mix) is given back.
        def back() -> bool:
            now = memory_detail(watcher)
            return (
                now["active_leases"] == base["active_leases"]
                and now["reservations"] == base["reservations"]
            )

        recovery = wait_for(back, 10.0, "the leases of killed and finished clients to be dropped")
        alive = watcher.health()
    record(
        "Clients",
        "16 clients mixed, 3 lease holders killed",
        f"16 clients x {MIX_SECONDS:.0f} s of put/get/lookup/delete (8 shm, 8 gRPC), "
        "every read verified byte for byte; 3 clients holding a lease and a reservation "
        "killed with SIGKILL",
        faults=kills,
        requests=tally.requests,
        lost=tally.lost,
        wrong=tally.wrong,
        recovery_s=recovery,
        notes=f"{tally.gets} gets ({tally.hits} hits), {tally.stored} chunks stored, "
        f"{tally.lookups} lookups, {tally.deletes} deletes; errors {tally.errors}",
    )
    assert alive, f"server died:\n{srv.log()}"
    assert tally.errors == 0 and tally.lost == 0 and tally.wrong == 0, (
        f"{tally.summary()}\n" + "\n".join(tally.details)
    )
    assert tally.requests > 16 * 20 and tally.hits > 100, f"too little load: {tally.summary()}"
    assert kills >= 1
    assert srv.stop() == 0, srv.log()


def _nothing(stop: threading.Event) -> Iterator[Any]:
    stop.wait()
    return
    yield  # pragma: no cover - a generator that never yields


def test_silent_clients_cannot_starve_the_server(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    """Clients that connect and send nothing: bare TCP connections, Put and Session streams
    that never send a message, a Get whose reader stops reading. With 4 RPC threads and 4
    session threads, 12 silent Puts and 6 silent Sessions would hold every thread: the server
    admits only 3 Put/Get streams (a quarter of the RPC threads stays for other calls) and
    4 Session streams, refuses the rest at once, and cancels the admitted ones once they have
    moved nothing for a lease; Info answers throughout."""
    lease_ms = 3000
    srv = make_server(
        "silent",
        args=[
            *SERVER_ARGS,
            "--max-concurrent-rpcs",
            "4",
            "--max-sessions",
            "4",
            "--lease-ms",
            str(lease_ms),
        ],
    ).start()
    stop = threading.Event()
    socks: list[socket.socket] = []
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        with kvstore.Client(srv.tcp_url, shm=False) as c:
            data = np.random.default_rng(3).integers(0, 256, 8 << 20, dtype=np.uint8)
            ns = kvstore.keys.Namespace(model="silent", dtype="bfloat16", layout="big")
            big, status = c.put_chunk(
                ns, ROOT, np.arange(16, dtype=np.uint32), data, "bfloat16", (16, 256 << 10)
            )
            assert status.ok, status
        stub = pb_grpc.KVStoreStub(channel)
        stalled_get = stub.Get(pb.GetRequest(key=big))
        next(stalled_get)  # the header; then the reader stops reading
        socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(50)]
        puts = [stub.Put.future(_nothing(stop)) for _ in range(12)]
        sessions = [stub.Session(_nothing(stop)) for _ in range(6)]
        assert len(sessions) == 6
        t_open = time.monotonic()
        silent = 50 + 12 + 6 + 1
        saturated = False
        with kvstore.Client(srv.tcp_url, shm=False) as c:
            while not saturated and time.monotonic() - t_open < lease_ms / 1000 - 0.5:
                try:  # were every thread held, nobody would be served
                    c.info(timeout=0.3)
                    time.sleep(0.05)  # the silent streams are still being dispatched
                except kvstore.errors.DeadlineExceeded:
                    saturated = True
        with kvstore.Client(srv.tcp_url, shm=False, timeout=3 * lease_ms / 1000 + 10) as c:
            info = c.info()
            answered = time.monotonic() - t_open
            codes = []
            for f in puts:  # the admitted ones end once idle for a lease
                try:
                    f.result(timeout=10)
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)
            n_cancelled = codes.count("CANCELLED")
            n_refused = codes.count("RESOURCE_EXHAUSTED")
            time.sleep(1.0)  # the stalled Get's slot: cancelled in the same sweep or the next
            got = c.get(big)
            assert got is not None and got[1] == data.tobytes(), "wrong bytes after the stall"
    finally:
        stop.set()
        for s in socks:
            s.close()
        channel.close()
    record(
        "Clients",
        "silent clients",
        "50 TCP connections that send nothing, 12 Put and 6 Session streams that never send "
        "a message, 1 Get whose reader stops; 4 RPC + 4 session threads",
        faults=silent,
        requests=2,
        recovery_s=answered,
        notes=f"every thread held: {saturated}; answered again {answered:.1f} s after the "
        f"silent streams opened (lease {lease_ms} ms); {n_refused} silent Puts refused at "
        f"once, {n_cancelled} cancelled; recovery = streams open to answered",
    )
    assert not saturated, "the silent streams held every thread: Info did not answer"
    assert info.server_version, info
    assert answered < 3 * lease_ms / 1000 + 5, f"the server answered only after {answered:.1f} s"
    assert n_cancelled + n_refused == 12, f"silent Put streams ended with {codes}"
    assert 1 <= n_cancelled <= 3, f"{n_cancelled} silent Puts admitted: at most 3 slots ({codes})"
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()
