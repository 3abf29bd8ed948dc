"""Streams that outlive their holds: slow Put and Get streams, a client posing as the server.

A Put or Get stream relays bytes between the socket and pages of the L1 arena
that the server holds for it (a reservation, a read lease). These tests keep such
a stream alive past the hold's lease, or drop the server's holds from outside,
while other puts want the same pages, and then check every acknowledged chunk
byte for byte with a raw gRPC reader (no client-side checksum to hide behind).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import kvstore
import kvstore.errors
import kvstore.keys
from kvstore.keys import ROOT, ChunkKey
from kvstore.protocol import AUTH_HEADER, SERVICE_NAME, frame, unframe
from kvstore.records import parse_header
from kvstore.testing.server import KVServer
from kvstore.v1 import kvstore_pb2 as pb
from tests.server.helpers import chunk_header_for, memory_detail, namespace, payload, tokens

BPT = 4096  # bytes per token: a 64-token chunk is 256 KiB
NO_BDP = [("grpc.http2.bdp_probe", 0)]  # keep the flow-control window small: reads stay lazy


def _raw_put(
    channel: grpc.Channel, frames: Iterator[bytes], timeout: float = 30
) -> pb.PutResponse | grpc.StatusCode:
    put = channel.stream_unary(
        f"/{SERVICE_NAME}/Put",
        request_serializer=None,
        response_deserializer=pb.PutResponse.FromString,
    )
    try:
        return put(frames, timeout=timeout)
    except grpc.RpcError as e:
        return e.code()


def _raw_get(
    channel: grpc.Channel, key: ChunkKey, after_first: Callable[[], None]
) -> bytes | grpc.StatusCode | None:
    """The payload a raw reader receives (no checksum checked); ``after_first`` runs
    between the first payload piece and the rest."""
    get = channel.unary_stream(
        f"/{SERVICE_NAME}/Get",
        request_serializer=pb.GetRequest.SerializeToString,
        response_deserializer=None,
    )
    out, pieces = bytearray(), 0
    try:
        for msg in get(pb.GetRequest(key=key), timeout=60):
            field, value = unframe(msg, pb.GetResponse)
            if field == 2:
                out += value
                pieces += 1
                if pieces == 1:
                    after_first()
    except grpc.RpcError as e:
        return e.code()
    return bytes(out) if pieces else None


def _put(
    c: kvstore.Client, ns: Any, start: int, n_tokens: int, seed: int, bpt: int = BPT
) -> tuple[Any, bytes]:
    toks = tokens(n_tokens, start)
    data = payload(n_tokens * bpt, seed)
    key, status = c.put_chunk(ns, ROOT, toks, data, "bfloat16", (n_tokens, bpt // 2))
    return (key if status.ok else None), data.tobytes()


def _holds_left(srv: KVServer) -> tuple[int, int]:
    """(leases, reservations) the server still holds, once its streams have ended."""
    deadline = time.monotonic() + 5
    with kvstore.Client(srv.unix_url, shm=False) as c:
        while True:
            d = memory_detail(c)
            left = (d["active_leases"], d["reservations"])
            if left == (0, 0) or time.monotonic() > deadline:
                return left
            time.sleep(0.1)


def _verify(srv: KVServer, chunks: dict[ChunkKey, bytes]) -> tuple[int, int]:
    """(lost, wrong) over acknowledged chunks, read with a raw reader."""
    lost = wrong = 0
    with grpc.insecure_channel(f"unix:{srv.socket}") as ch:
        for key, data in chunks.items():
            got = _raw_get(ch, key, lambda: None)
            if not isinstance(got, bytes):
                lost += 1
            elif got != data:
                wrong += 1
    return lost, wrong


def test_slow_put_stream_never_writes_into_another_chunk(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    # 16 pages of 64 KiB, no disk: two 13-page records cannot both fit, so a put
    # that arrives while the slow stream is on hold can only use the slow put's pages.
    srv = make_server(
        "slowput",
        memory="1MiB",
        args=["--no-disk", "--lease-ms", "1000", "--sweep-interval", "10"],
    ).start()
    ns = namespace("slowput", BPT)
    n = 192  # 768 KiB
    header = chunk_header_for(ns, tokens(n, 0), BPT, seed=1)
    slow_data = payload(n * BPT, 1).tobytes()
    acked: dict[ChunkKey, bytes] = {}
    other: dict[str, Any] = {}

    def slow_frames() -> Iterator[bytes]:
        yield frame(1, header.pack())
        yield frame(2, slow_data[: 256 * 1024])
        time.sleep(1.3)  # the reservation's lease (1 s) runs out while the stream lives
        with kvstore.Client(srv.unix_url, shm=False) as c:
            other["key"], other["data"] = _put(c, ns, 10_000, n, seed=2)
        time.sleep(0.3)
        for off in range(256 * 1024, len(slow_data), 256 * 1024):
            yield frame(2, slow_data[off : off + 256 * 1024])

    with grpc.insecure_channel(f"unix:{srv.socket}") as ch:
        got = _raw_put(ch, slow_frames())
    slow_stored = isinstance(got, pb.PutResponse) and got.status == pb.STORED
    if slow_stored:
        acked[header.key] = slow_data
    if other.get("key") is not None:
        acked[other["key"]] = other["data"]
    lost, wrong = _verify(srv, acked)
    record(
        "Streams",
        "slow Put stream outlives its reservation",
        "a raw Put stream pauses 1.6 s (lease 1 s) between pieces while another put of the "
        "same size wants the same pages of a 16-page arena; every acknowledged chunk read "
        "back raw",
        faults=1,
        requests=2,
        lost=lost,
        wrong=wrong,
        notes=f"slow put: {getattr(got, 'status', got)}; other put acknowledged: "
        f"{other.get('key') is not None}",
    )
    assert acked, f"neither put was acknowledged (slow put: {got})"
    assert (lost, wrong) == (0, 0), (
        f"{lost} acknowledged chunks lost, {wrong} served wrong: the slow stream wrote into "
        "pages given to another chunk"
    )
    assert srv.stop() == 0, srv.log()


def _slow_get(
    srv: KVServer,
    meanwhile: Callable[[kvstore.Client], None],
    record: Callable[..., Any],
    **row: Any,
) -> None:
    """A raw reader of an 8 MiB chunk stops after its first piece; ``meanwhile`` runs,
    then two more 8 MiB puts want the arena (3 x 129 pages > 384: one chunk moves
    down to L2) and the reader resumes: it must get the chunk's own bytes, or an
    error, never another's; every acknowledged chunk is still served, right."""
    bpt = 32 * 1024  # 256 tokens: 8 MiB
    ns = namespace("slowget", bpt)
    acked: dict[ChunkKey, bytes] = {}
    with kvstore.Client(srv.unix_url, shm=False) as c:
        key_a, data_a = _put(c, ns, 0, 256, seed=1, bpt=bpt)
        assert key_a is not None

        def pause() -> None:
            meanwhile(c)
            for i in (2, 3):
                k, d = _put(c, ns, 100_000 * i, 256, seed=i, bpt=bpt)
                if k is not None:
                    acked[k] = d

        with grpc.insecure_channel(f"unix:{srv.socket}", options=NO_BDP) as ch:
            got = _raw_get(ch, key_a, pause)
    wrong = int(isinstance(got, bytes) and got != data_a)
    lost, wrong_others = _verify(srv, acked)
    record(
        "Streams",
        faults=1,
        requests=4,
        lost=lost,
        wrong=wrong + wrong_others,
        notes="slow reader got "
        + ("its own bytes" if got == data_a else "WRONG bytes" if wrong else str(got)),
        **row,
    )
    assert not wrong, "a raw reader was streamed another chunk's bytes as a success"
    assert got == data_a or isinstance(got, grpc.StatusCode), got
    assert (lost, wrong_others) == (0, 0), (lost, wrong_others)
    assert _holds_left(srv) == (0, 0), "the Get stream's lease outlived it"
    assert srv.stop() == 0, srv.log()


def test_slow_get_stream_never_serves_another_chunk(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    srv = make_server(
        "slowget",
        memory="24MiB",
        args=[
            "--lease-ms",
            "1000",
            "--sweep-interval",
            "10",
            "--piece-bytes",
            "65536",
        ],
    ).start()
    _slow_get(
        srv,
        lambda c: time.sleep(1.5),  # the server's read lease (1 s) runs out
        record,
        scenario="slow Get stream outlives its read lease",
        done="a raw reader of an 8 MiB chunk (64 KiB pieces) stops for 1.5 s (lease 1 s) while "
        "two more 8 MiB puts need its pages, then reads on; its bytes and the others' compared",
    )


@pytest.mark.parametrize("owner", ["kvstore-server", ""])
def test_no_client_can_drop_the_servers_own_holds(
    make_server: Callable[..., KVServer], record: Callable[..., Any], owner: str
) -> None:
    srv = make_server(
        "poser",
        memory="24MiB",
        args=["--sweep-interval", "10", "--piece-bytes", "65536"],
    ).start()

    def pose(c: kvstore.Client) -> None:
        # A Session under the owner name the server uses for its own streams (or none),
        # opened and closed: on its end the server drops everything that owner holds.
        with grpc.insecure_channel(f"unix:{srv.socket}") as ch:
            session = ch.stream_stream(
                f"/{SERVICE_NAME}/Session",
                request_serializer=pb.SessionPing.SerializeToString,
                response_deserializer=pb.SessionPong.FromString,
            )
            meta = (("x-kvstore-session", "kvstore-server"),) if not owner else ()
            done = threading.Event()

            def pings() -> Iterator[pb.SessionPing]:
                yield pb.SessionPing(owner=owner)
                done.wait(5)

            calls = session(pings(), metadata=meta, timeout=10)
            try:
                next(calls, None)
            except grpc.RpcError:
                pass
            done.set()
            try:
                for _ in calls:
                    pass
            except grpc.RpcError:
                pass

    _slow_get(
        srv,
        pose,
        record,
        scenario=f"a client poses as the server (Session owner {owner or 'header'!r})",
        done="while a raw reader streams an 8 MiB chunk, a client opens and closes a Session "
        "named like the server's own holds; two more 8 MiB puts then need the reader's pages",
    )


def test_header_of_a_slow_get_is_its_own(make_server: Callable[..., KVServer]) -> None:
    """The parse helper agrees with what the server sends (guards the raw reader above)."""
    srv = make_server("hdr", memory="8MiB", args=["--no-disk"]).start()
    with kvstore.Client(srv.unix_url, shm=False) as c:
        key, data = _put(c, namespace("hdr", BPT), 0, 64, seed=5)
    with grpc.insecure_channel(f"unix:{srv.socket}") as ch:
        get = ch.unary_stream(
            f"/{SERVICE_NAME}/Get",
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=None,
        )
        first = next(iter(get(pb.GetRequest(key=key), timeout=10)))
        field, value = unframe(first, pb.GetResponse)
        assert field == 1 and parse_header(value).key == key
    assert _verify(srv, {key: data}) == (0, 0)
    assert srv.stop() == 0, srv.log()


def _answers(srv: KVServer, stop: threading.Event, slowest: list[float]) -> None:
    """Info and Stats, over and over until ``stop``: the slowest answer (inf: none)."""
    with kvstore.Client(srv.tcp_url, shm=False, timeout=3) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                c.info(timeout=3)
                c.stats(timeout=3)
                slowest[0] = max(slowest[0], time.monotonic() - t0)
            except kvstore.errors.KVStoreError:
                slowest[0] = float("inf")
            time.sleep(0.05)


def test_session_flood_leaves_threads_for_everyone(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    """Hundreds of pinging Session streams, under one owner and under many: past the
    per-owner and total limits they are refused at once, and Info and Stats still answer.
    Before the limit counted streams, 8 + 16 threads were all held by one owner's pings."""
    srv = make_server(
        "flood", args=["--max-concurrent-rpcs", "8", "--max-sessions", "16", "--no-disk"]
    ).start()
    stop, slowest = threading.Event(), [0.0]
    watcher = threading.Thread(target=_answers, args=(srv, stop, slowest))
    watcher.start()
    codes: list[str] = []
    lock = threading.Lock()
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    session = channel.stream_stream(
        f"/{SERVICE_NAME}/Session",
        request_serializer=pb.SessionPing.SerializeToString,
        response_deserializer=pb.SessionPong.FromString,
    )

    def ping(owner: str) -> None:
        def pings() -> Iterator[pb.SessionPing]:
            while not stop.is_set():
                yield pb.SessionPing(owner=owner)
                stop.wait(0.2)

        try:
            for _ in session(pings(), timeout=30):
                if stop.is_set():
                    break
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        with lock:
            codes.append(code)

    owners = ["one"] * 150 + [f"many-{i}" for i in range(150)]
    threads = [threading.Thread(target=ping, args=(o,)) for o in owners]
    try:
        for t in threads:
            t.start()
        time.sleep(4)
        with kvstore.Client(srv.tcp_url, shm=False, timeout=5) as c:
            key, data = _put(c, namespace("flood", BPT), 0, 16, seed=1)
            after = c.get(key) if key is not None else None
        with lock:
            refused_early = codes.count("RESOURCE_EXHAUSTED")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        watcher.join(30)
        channel.close()
    record(
        "Streams",
        "Session flood",
        "300 pinging Session streams (150 under one owner, 150 under as many owners) "
        "against 8 RPC + 16 session threads, Info and Stats called every 50 ms meanwhile; "
        "a put and a get in the middle",
        faults=300,
        requests=300 + 2,
        lost=0 if after is not None and after[1] == data else 1,
        notes=f"{refused_early} refused with RESOURCE_EXHAUSTED while the flood ran; "
        f"slowest Info+Stats {slowest[0]:.2f} s",
    )
    assert slowest[0] < 3, f"Info/Stats stalled under the flood (slowest {slowest[0]:.2f} s)"
    assert after is not None and after[1] == data, "a put and get under the flood failed"
    # Of 150 streams of one owner at most 4 run; of 150 others at most 16 - 4.
    assert refused_early >= 300 - 16, f"only {refused_early} of 300 sessions were refused"
    assert srv.stop() == 0, srv.log()


def test_trickling_puts_are_cancelled(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    """Put streams that send a byte every 0.2 s are never idle; they are slow for their size
    (64 KiB at 64 KiB/s: due after lease + 1 s) and are cancelled, and more of them than the
    server's stream slots are refused at once, so Info and Stats keep answering."""
    srv = make_server(
        "trickle",
        args=["--max-concurrent-rpcs", "4", "--lease-ms", "2000", "--no-disk"],
        env={"KVSTORE_STREAM_MIN_BYTES_PER_S": str(64 * 1024)},
    ).start()
    ns = namespace("trickle", 1024)
    stop, slowest = threading.Event(), [0.0]
    watcher = threading.Thread(target=_answers, args=(srv, stop, slowest))
    watcher.start()
    results: list[tuple[Any, float]] = []
    lock = threading.Lock()

    def trickle(i: int) -> None:
        header = chunk_header_for(ns, tokens(64, 1000 * i), 1024, seed=i)

        def frames() -> Iterator[bytes]:
            yield frame(1, header.pack())
            for _ in range(64 * 1024):
                if stop.is_set():
                    return
                yield frame(2, b"\0")
                time.sleep(0.2)

        t0 = time.monotonic()
        with grpc.insecure_channel(f"unix:{srv.socket}") as ch:
            got = _raw_put(ch, frames(), timeout=60)
        with lock:
            results.append((got, time.monotonic() - t0))

    threads = [threading.Thread(target=trickle, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        watcher.join(30)
    codes = sorted(str(getattr(r, "name", r)) for r, _ in results)
    longest = max((s for _, s in results), default=float("inf"))
    record(
        "Streams",
        "trickling Put streams",
        "8 Put streams that send one byte every 0.2 s (never idle) against 4 RPC threads, "
        "64 KiB/s minimum rate, lease 2 s; Info and Stats called every 50 ms meanwhile",
        faults=8,
        requests=8,
        notes=f"outcomes {codes}; the longest lived {longest:.1f} s; slowest Info+Stats "
        f"{slowest[0]:.2f} s",
    )
    assert len(results) == 8, "a trickling Put was still running after 20 s"
    assert all(isinstance(r, grpc.StatusCode) for r, _ in results), codes
    assert set(codes) <= {"CANCELLED", "RESOURCE_EXHAUSTED"}, codes
    assert longest < 2 + 1 + 3, f"a trickling Put lived {longest:.1f} s"
    assert slowest[0] < 3, f"Info/Stats stalled under the trickle (slowest {slowest[0]:.2f} s)"
    assert _holds_left(srv) == (0, 0), "a cancelled Put stream kept its reservation"
    assert srv.stop() == 0, srv.log()


def test_reader_too_slow_for_its_size_is_cancelled_and_its_lease_given_back(
    make_server: Callable[..., KVServer],
) -> None:
    """The other end of a lasting hold: a reader that stops for longer than its chunk's
    deadline (lease 1 s + 8 MiB at 4 MiB/s) loses the stream, and the lease goes with it."""
    srv = make_server(
        "tooslow",
        memory="24MiB",
        args=["--lease-ms", "1000", "--piece-bytes", "65536"],
        env={"KVSTORE_STREAM_MIN_BYTES_PER_S": str(4 << 20)},
    ).start()
    bpt = 32 * 1024
    with kvstore.Client(srv.unix_url, shm=False) as c:
        key, _ = _put(c, namespace("tooslow", bpt), 0, 256, seed=1, bpt=bpt)
    with grpc.insecure_channel(f"unix:{srv.socket}", options=NO_BDP) as ch:
        t0 = time.monotonic()
        got = _raw_get(ch, key, lambda: time.sleep(4.5))
    assert got == grpc.StatusCode.CANCELLED, f"a reader stalled past its deadline got {got!r}"
    assert time.monotonic() - t0 < 10
    assert _holds_left(srv) == (0, 0), "the cancelled Get stream's lease was not given back"
    assert srv.stop() == 0, srv.log()


def test_one_tenant_cannot_take_every_stream_slot(
    make_server: Callable[..., KVServer], tmp_path: Path, record: Callable[..., Any]
) -> None:
    """Stream slots are bounded in all (Put and Get: the call threads less a reserve), and
    on a server with tenants per tenant too: alpha opens more stalled Put streams than the
    server takes; it gets its share (half of the 6 data streams of 8 call threads), and
    beta's put still goes through. Before, alpha's streams took every slot and beta's put
    was refused (RESOURCE_EXHAUSTED) until alpha's streams were cancelled."""
    admin, alpha, beta = "admin-s3cret", "alpha-s3cret", "beta-s3cret"
    tenants = tmp_path / "tenants"
    tenants.write_text(f"alpha:{alpha}\nbeta:{beta}\n")
    srv = make_server(
        "share",
        args=[
            *("--token", admin, "--tenant-tokens", str(tenants)),
            *("--max-concurrent-rpcs", "8", "--lease-ms", "10000", "--no-disk"),
        ],
    ).start()
    stop = threading.Event()
    codes: list[str] = []
    lock = threading.Lock()

    def stalled() -> None:
        def frames() -> Iterator[bytes]:  # sends nothing until the test is done
            stop.wait(30)
            yield from ()

        put = grpc.insecure_channel(f"unix:{srv.socket}")
        call = put.stream_unary(
            f"/{SERVICE_NAME}/Put",
            request_serializer=None,
            response_deserializer=pb.PutResponse.FromString,
        )
        try:
            call(frames(), timeout=30, metadata=[(AUTH_HEADER, f"Bearer {alpha}")])
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        finally:
            put.close()
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=stalled) for _ in range(8)]
    ns = kvstore.keys.Namespace(model="share", dtype="bfloat16", layout="t", salt="beta")
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(codes) < 5:
            time.sleep(0.05)  # the refusals come back at once; the stalled ones wait
        refused = sorted(codes)
        with kvstore.Client(srv.unix_url, token=beta, shm=False, timeout=5) as b:
            try:
                _, status = b.put_chunk(
                    ns, ROOT, tokens(64), payload(64 * 1024, seed=1), "uint8", (64, 1024)
                )
                beta_put = status.name
            except kvstore.errors.KVStoreError as e:
                beta_put = f"{type(e).__name__}: {e}"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    record(
        "Streams",
        "one tenant opens every stream slot",
        "tenant alpha opens 8 stalled Put streams against 8 call threads (6 data-stream "
        "slots); then tenant beta puts a chunk",
        faults=8,
        requests=9,
        notes=f"alpha's refused at once: {refused}; beta's put: {beta_put}",
    )
    assert refused == ["RESOURCE_EXHAUSTED"] * 5, f"alpha was not held to its share: {refused}"
    assert beta_put == "STORED", f"beta's put did not get through: {beta_put}\n{srv.log()}"
    assert srv.stop() == 0, srv.log()
