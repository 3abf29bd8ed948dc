"""The express plane (``kvstore.express``): the unary calls over a second Unix socket.

The blocking client takes it by itself when it dials the server's Unix socket, so the
contract suite (test_client_contract.py) runs every unary call of ``kvstore.Client``
over it, and those of ``kvstore.AsyncClient`` over gRPC. Here: that the calls really go
that way, what they answer is what gRPC answers (errors included), who may connect, and
what a client does when the plane is not there, full, restarted or stalled.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

import kvstore
from kvstore import express
from kvstore.errors import InvalidArgument, KVStoreError, Unauthenticated
from kvstore.keys import ROOT, Namespace
from kvstore.sdk.client import chunk_header
from kvstore.testing.server import KVServer
from kvstore.types import PutStatus
from kvstore.v1 import kvstore_pb2 as pb
from tests.server.helpers import namespace, payload, put_chain, shape_for, tokens

MakeServer = Callable[..., KVServer]
TOKEN = "s3cret-express"


def _raw_call(
    path: str, metadata: list[tuple[str, str]], method: str, body: bytes
) -> list[tuple[int, bytes]]:
    """HELLO with ``metadata`` then one call, sent at once on a socket of its own: the
    replies read (two, or fewer where the server ended the connection)."""
    out: list[tuple[int, bytes]] = []
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(express.request_frame(express.HELLO, express.hello_body(metadata)))
        s.sendall(express.request_frame(method, body))
        while len(out) < 2 and (head := express.recv_exact(s, express.REPLY.size)) is not None:
            size, code, _ = express.REPLY.unpack(head)
            out.append((code, express.recv_exact(s, size) or b""))
    return out


def _store(c: kvstore.Client, ns: Namespace, n: int) -> np.ndarray:
    """Put ``n`` chunks of one prompt; its tokens."""
    toks = tokens(n * 256)
    put_chain(c, ns, toks, 256, 512)
    return toks


def test_a_unix_client_makes_its_unary_calls_over_the_express_socket(server: KVServer) -> None:
    """Once the server's Info is known (asked in the background by the first call, which
    goes by gRPC, or by the client itself)."""
    ns = namespace("express-calls")
    with kvstore.Client(server.unix_url) as c:
        info = c.info()
        assert info.express_socket == f"{server.socket}{express.SUFFIX}", info
        assert os.path.exists(info.express_socket)
        link = c.express
        assert link is not None, "a client of the Unix socket takes the express plane"
        toks = _store(c, ns, 4)
        counts = server_counts(c)
        before = link.calls
        assert c.lookup(ns, toks).matched_tokens == 4 * 256
        leases = c.acquire_many([m.key for m in c.lookup(ns, toks).chunks])
        held = [x for x in leases if isinstance(x, kvstore.sdk.Lease)]
        assert len(held) == 4, leases
        c.release_many(held)
        assert link.calls - before == 4, "Lookup, Lookup, AcquireMany, Release"
        after = server_counts(c)
        for name, n in (("Lookup", 2), ("AcquireMany", 1), ("Release", 1)):
            assert after.get(name, 0) - counts.get(name, 0) == n, (name, counts, after)
    with kvstore.Client(server.tcp_url) as tcp:
        tcp.info()
        assert tcp.express is None, "TCP clients stay on gRPC"


def server_counts(c: kvstore.Client) -> dict[str, int]:
    return {k: int(v) for k, v in c.stats().extra.get("requests", {}).items()}


def test_errors_read_back_alike_over_both_transports(server: KVServer) -> None:
    """A refused call raises the same class with the same message either way."""
    seen = []
    for use in (True, False):
        with kvstore.Client(server.unix_url) as c:
            c.use_express = use
            c.info()  # the plane is taken (or not) from here on
            with pytest.raises(InvalidArgument) as e:
                c.exists([b"short"])
            seen.append(str(e.value))
            assert (c.express is not None) == use
    assert seen[0] == seen[1], seen


def test_the_hello_is_refused_without_the_right_token(make_server: MakeServer) -> None:
    srv = make_server(args=["--token", TOKEN]).start()
    path = f"{srv.socket}{express.SUFFIX}"
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]
    for metadata, why in (
        ([], "missing bearer token"),
        ([("authorization", "Bearer no")], "wrong"),
    ):
        replies = _raw_call(path, metadata, "Stats", pb.StatsRequest().SerializeToString())
        assert len(replies) == 1, f"only the refusal, then the connection ends: {replies}"
        code, body = replies[0]
        assert code == unauthenticated and why in express.parse_error(body)[0], replies
    good = [("authorization", f"Bearer {TOKEN}")]
    replies = _raw_call(path, good, "Stats", pb.StatsRequest().SerializeToString())
    assert [code for code, _ in replies] == [0, 0], replies
    with kvstore.Client(srv.unix_url, token=TOKEN) as c:
        c.info()  # the plane is taken once the server's Info is known
        assert c.stats().chunks == 0 and c.express is not None and c.express.calls >= 1
    with kvstore.Client(srv.unix_url, token="wrong") as c, pytest.raises(Unauthenticated):
        c.stats()


def test_bad_frames_are_answered_and_end_the_connection(make_server: MakeServer) -> None:
    srv = make_server(args=["--max-message-bytes", "65536", "--piece-bytes", "16384"]).start()
    path = f"{srv.socket}{express.SUFFIX}"
    codes = {c.value[0]: c for c in grpc.StatusCode}
    replies = _raw_call(path, [], "Nope", b"")
    assert [codes[c] for c, _ in replies] == [grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED]
    replies = _raw_call(path, [], "Lookup", b"\xff" * 70_000)
    assert [codes[c] for c, _ in replies] == [
        grpc.StatusCode.OK,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ]
    assert "max_message_bytes" in express.parse_error(replies[1][1])[0]
    with socket.socket(socket.AF_UNIX) as s:  # too big, and not waited for: no answer
        s.settimeout(10)
        s.connect(path)
        s.sendall(express.request_frame(express.HELLO, express.hello_body([])))
        assert express.recv_exact(s, express.REPLY.size) is not None
        s.sendall(express.request_frame("Release", b"\0" * 70_000, express.NO_REPLY))
        try:  # the rest of the frame unread: the end may come as a reset
            got = s.recv(1)
        except ConnectionResetError:
            got = b""
        assert got == b"", "the connection ends without a reply a next call could take"
    replies = _raw_call(path, [], "Lookup", b"\xff\xff")
    assert codes[replies[1][0]] == grpc.StatusCode.INVALID_ARGUMENT, replies
    with socket.socket(socket.AF_UNIX) as s:  # a first frame that is not a HELLO
        s.connect(path)
        s.sendall(express.request_frame("Stats", b""))
        head = express.recv_exact(s, express.REPLY.size)
        assert head is not None and codes[express.REPLY.unpack(head)[1]].name == "INVALID_ARGUMENT"
    with kvstore.Client(srv.unix_url) as c:
        assert c.stats().chunks == 0, "the server serves on after all of them"


def test_without_the_plane_or_with_it_full_calls_go_by_grpc(make_server: MakeServer) -> None:
    off = make_server("off", args=["--no-express"]).start()
    with kvstore.Client(off.unix_url) as c:
        assert c.info().express_socket == "" and c.express is None
        assert c.stats().chunks == 0
    assert not os.path.exists(f"{off.socket}{express.SUFFIX}")

    full = make_server("full", env={"KVSTORE_EXPRESS_CONNECTIONS": "1"}).start()
    with socket.socket(socket.AF_UNIX) as hog:
        hog.connect(f"{full.socket}{express.SUFFIX}")
        hog.sendall(express.request_frame(express.HELLO, express.hello_body([])))
        assert express.recv_exact(hog, express.REPLY.size) is not None
        with kvstore.Client(full.unix_url) as c:
            for _ in range(3):
                assert c.stats().chunks == 0, "answered over gRPC"
            assert c.express is not None and c.express.calls == 0, "the only connection is taken"


def test_a_restarted_server_is_reached_again_over_its_new_socket(make_server: MakeServer) -> None:
    srv = make_server().start()
    ns = namespace("express-restart")
    with kvstore.Client(srv.unix_url) as c:
        toks = _store(c, ns, 2)
        link = c.express
        assert link is not None and link.calls > 0
        srv.stop()
        srv.start()
        # The pooled connection is dead: it is let go unused, a new one made.
        assert c.lookup(ns, toks).matched_tokens == 2 * 256, "L2 kept the chunks"
        calls = link.calls
        c.stats()
        assert link.calls == calls + 1, "still over the express plane"


def _stopped(pid: int) -> None:
    """Wait until a SIGSTOP took effect: kill returns before the process stops, and on
    this 2-core host the server may answer one more call in between."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            if "\nState:\tT" in f.read():
                return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


def test_a_stalled_server_fails_the_call_at_its_deadline(make_server: MakeServer) -> None:
    srv = make_server().start()
    assert srv.proc is not None
    with kvstore.Client(srv.unix_url, timeout=0.5) as c:
        c.info()
        assert c.express is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            _stopped(srv.proc.pid)
            t0 = time.monotonic()
            with pytest.raises(KVStoreError) as e:
                c.stats()
            took = time.monotonic() - t0
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert 0.4 < took < 3.0, f"failed after {took:.2f} s, deadline 0.5 s"
        assert "Deadline" in str(e.value) or "DEADLINE" in str(e.value), e.value
        assert c.stats().chunks == 0, "the next call is answered"


def _unsealed(ns: Namespace, n: int) -> tuple[list[Any], list[np.ndarray]]:
    """``n`` chunks of 64 tokens (32 KiB) for a put_many: headers with placeholder
    checksums, and their payloads."""
    headers = [
        chunk_header(ns, ROOT, tokens(64, 64 * i), None, "bfloat16", (64, 256)) for i in range(n)
    ]
    return headers, [payload(64 * 512, i) for i in range(n)]


def test_a_put_many_pipes_its_calls_on_one_connection(make_server: MakeServer) -> None:
    """A put_many's 8 calls ride one connection of the pool, which goes back to it; with
    the server stalled, the batch fails at its deadline, the connection with an answer
    still owed on it is closed (never pooled: that answer would be the next call's), and
    the next calls are answered right."""
    srv = make_server().start()
    assert srv.proc is not None
    ns = namespace("express-pipe", 512)
    headers, datas = _unsealed(ns, 16)
    with kvstore.Client(srv.unix_url, timeout=0.5) as c:
        c.info()
        link = c.express
        assert link is not None and c.shm_active  # the arena mapped before counting
        calls = link.calls
        assert c.put_many(headers[:8], datas[:8], checksum_at_commit=True) == [PutStatus.STORED] * 8
        assert link.calls == calls + 8, "4 ReserveMany and 4 CommitMany over the express plane"
        assert len(link._idle) == 1, "the pipe's connection goes back to the pool"
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            _stopped(srv.proc.pid)
            t0 = time.monotonic()
            with pytest.raises(KVStoreError, match=r"(?i)deadline"):
                c.put_many(headers[8:], datas[8:], checksum_at_commit=True)
            took = time.monotonic() - t0
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert took < 3.0, f"failed after {took:.2f} s, deadline 0.5 s"
        assert not link._idle, "a connection with an answer owed was pooled again"
        got = c.put_many(headers, datas, checksum_at_commit=True)
        assert got == [PutStatus.EXISTS] * 8 + [PutStatus.STORED] * 8, got
        one = c.get(headers[12].key)
        assert one is not None and one[1] == datas[12].tobytes()


def test_a_pipe_reads_the_replies_that_would_block_the_server(make_server: MakeServer) -> None:
    """8,000 reservations in a put_many: 8 ReserveMany frames go out before any reply is
    read, and their replies fill this end's buffer. Before, the server blocked writing
    one, read no more of the request being written, and both waited (until the server's
    frame timeout, 30 s). Now the pipe reads the replies as they come while it writes."""
    srv = make_server(
        "express-big", memory="64MiB", env={"KVSTORE_MEMORY_PAGE_BYTES": "4096"}
    ).start()
    ns = namespace("express-big", 16)
    data = payload(16 * 16, 1)
    headers = [
        chunk_header(ns, ROOT, tokens(16, 16 * i), None, "bfloat16", (16, 8)) for i in range(8000)
    ]
    with kvstore.Client(srv.unix_url, timeout=10) as c:
        assert c.shm_active and c.express is not None
        t0 = time.monotonic()
        got = c.put_many(headers, [data] * len(headers), checksum_at_commit=True)
        took = time.monotonic() - t0
        assert got == [PutStatus.STORED] * len(headers), set(got)
        assert took < 8, f"{took:.1f} s for 8,000 small chunks"
        one = c.get(headers[7999].key)
        assert one is not None and one[1] == data.tobytes()
        assert c.express.calls > 16, "the batch did not go over the express plane"


def test_a_pipes_reply_is_waited_for_from_when_it_is_asked_for(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client copies between a pipe's calls: a reply that came while it copied is not
    late. With 0.1 s a copy and a 0.3 s timeout, a put_many of 8 chunks (4 parts) took
    0.8 s: before, the reply to the fourth part's ReserveMany, sent at the start, was
    read past its deadline and the batch failed (DeadlineExceeded, 4 chunks stored, the
    others left to expire)."""
    from kvstore.sdk.shm import ReservationBase

    srv = make_server().start()
    ns = namespace("express-pipe-slow", 512)
    headers, datas = _unsealed(ns, 8)
    write = ReservationBase.write

    def slow(self: ReservationBase, data: Any) -> None:
        time.sleep(0.1)
        write(self, data)

    monkeypatch.setattr(ReservationBase, "write", slow)
    with kvstore.Client(srv.unix_url, timeout=0.3) as c:
        assert c.shm_active and c.express is not None
        got = c.put_many(headers, datas, checksum_at_commit=True)
        assert got == [PutStatus.STORED] * 8, got


def test_an_async_put_many_cancelled_on_a_stalled_server_is_cancelled(
    make_server: MakeServer,
) -> None:
    """AsyncClient's put_many waiting on a stalled server: cancelling its task raises
    CancelledError in the caller (before, the failure path asked the pipe for an answer
    it had taken already: IndexError)."""
    srv = make_server().start()
    assert srv.proc is not None
    ns = namespace("express-pipe-cancel", 512)
    headers, datas = _unsealed(ns, 4)

    async def body() -> None:
        async with kvstore.AsyncClient(srv.unix_url, timeout=10) as a:
            assert await a.stats() is not None and a.shm_active
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                _stopped(srv.proc.pid)
                task = asyncio.ensure_future(a.put_many(headers, datas, checksum_at_commit=True))
                await asyncio.sleep(0.3)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 5)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)

    asyncio.run(body())


def test_tenants_take_the_express_plane_under_their_own_rules(
    make_server: MakeServer, tmp_path: Any
) -> None:
    tenants = tmp_path / "tenants"
    tenants.write_text("alpha:alpha-token\n")
    srv = make_server(args=["--token", TOKEN, "--tenant-tokens", str(tenants)]).start()
    with kvstore.Client(srv.unix_url, token="alpha-token", shm=False) as c:
        assert c.info().express_socket, "offered to tenants too (unary calls only)"
        ns = Namespace(model="server-test", dtype="bfloat16", layout="alpha", salt="alpha")
        toks = tokens(256)
        data = payload(256 * 512, 1)
        h = chunk_header(ns, ROOT, toks, data, "bfloat16", shape_for(256, 512))
        assert c.lookup(ns, toks).matched_tokens == 0  # proves the namespace
        assert c.put(h, data).ok
        assert c.lookup(ns, toks).matched_tokens == 256
        assert c.express is not None and c.express.calls >= 2
        assert not c.info().shm_path, "and still no shared memory"


def test_a_forked_child_opens_connections_of_its_own(server: KVServer) -> None:
    """A child forked with the pool would share its parent's sockets: frames of both
    processes mixed on one, each reading answers to the other's calls (rarely: the
    kernel mostly wakes the reader that waited first, so wrong answers alone do not
    show it). It leaves them and dials its own: no socket of its pool is its parent's,
    and both look up prompts of their own, each answered right."""
    with kvstore.Client(server.unix_url) as c:
        mine, theirs = namespace("fork-parent"), namespace("fork-child")
        toks = _store(c, mine, 2)
        _store(c, theirs, 1)
        link = c.express
        assert link is not None
        parents = {os.fstat(s.fileno()).st_ino for s in link._idle}
        assert parents, "the parent pooled a connection"
        pid = os.fork()
        if pid == 0:  # the child: only the express plane, then out without cleanup
            code = 3
            try:
                got = {c.lookup(theirs, toks).matched_tokens for _ in range(100)}
                own = {os.fstat(s.fileno()).st_ino for s in link._idle}
                code = 1 if got != {256} else 2 if own & parents or not own else 0
            finally:
                os._exit(code)
        got = {c.lookup(mine, toks).matched_tokens for _ in range(100)}
        _, status = os.waitpid(pid, 0)
        assert got == {512}, f"the parent read other answers: {got}"
        code = os.waitstatus_to_exitcode(status)
        assert code != 2, "the child made its calls on its parent's sockets"
        assert code == 0, f"the child's calls failed ({code})"


class _StatsOnly:
    """A servicer answering every unary method with an empty StatsResponse: the listener
    alone is under test (how it treats a client stalled within a frame)."""

    def __getattr__(self, name: str) -> Any:
        return lambda request, context: pb.StatsResponse()


def test_a_client_stalled_within_a_frame_loses_its_connection(tmp_path: Any) -> None:
    """A connection may idle between frames as long as it likes (its client's pool keeps
    it), but once a frame began the rest must follow: a client that stops halfway does
    not hold the thread serving it."""
    from kvstore.server.express import ExpressPlane

    path = str(tmp_path / "x.express")
    plane = ExpressPlane(
        _StatsOnly(),
        path,
        refusal=lambda metadata: None,
        max_frame=1 << 20,
        max_connections=4,
        max_calls=2,
        frame_timeout_s=0.3,
    )
    hello = express.request_frame(express.HELLO, express.hello_body([]))
    try:
        with socket.socket(socket.AF_UNIX) as idle, socket.socket(socket.AF_UNIX) as stalled:
            for s in (idle, stalled):
                s.settimeout(10)
                s.connect(path)
                s.sendall(hello)
                assert express.recv_exact(s, express.REPLY.size) is not None
            stalled.sendall(express.request_frame("Stats", b"")[:3])  # a header cut short
            silent = socket.socket(socket.AF_UNIX)  # connects, never says who it is
            silent.settimeout(10)
            silent.connect(path)
            t0 = time.monotonic()
            assert stalled.recv(1) == b"", "the server ends the stalled connection"
            with silent:
                assert silent.recv(1) == b"", "and the one that sent no HELLO"
            assert time.monotonic() - t0 < 5
            time.sleep(0.6)  # twice the frame timeout, between frames
            idle.sendall(express.request_frame("Stats", b""))
            head = express.recv_exact(idle, express.REPLY.size)
            assert head is not None and express.REPLY.unpack(head)[1] == 0, "idle is kept"
    finally:
        plane.stop()
    assert not os.path.exists(path), "stop removes its socket"


def test_a_client_made_before_its_server_takes_the_plane_once_it_is_up(
    make_server: MakeServer,
) -> None:
    srv = make_server()
    with kvstore.Client(srv.unix_url, timeout=0.5) as c:
        with pytest.raises(KVStoreError):
            c.stats()  # nothing listens yet
        srv.start()
        deadline = time.monotonic() + 15
        while True:  # gRPC's channel waits out its reconnect backoff first
            try:
                assert c.stats().chunks == 0
                break
            except KVStoreError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.2)
        while c.express is None:  # the Info asked again in the background
            assert time.monotonic() < deadline, "the plane was never taken"
            c.stats()
            time.sleep(0.01)
        calls = c.express.calls
        assert c.stats().chunks == 0
        assert c.express.calls == calls + 1, "looked again at a later call"


def test_the_first_call_waits_for_no_info(server: KVServer) -> None:
    """A client's first call goes by gRPC while the Info that locates the plane is asked
    in the background: a scheduler's first lookup has a deadline of its own, shorter than
    the client's. Later calls take the plane once the answer is in."""
    with kvstore.Client(server.unix_url) as c:
        assert c.stats().chunks >= 0
        deadline = time.monotonic() + 10
        while c.express is None:
            assert time.monotonic() < deadline, "the background Info never set the plane up"
            time.sleep(0.01)
        calls = c.express.calls
        c.stats()
        assert c.express.calls == calls + 1


def test_pooled_connections_past_descriptor_1023_are_checked(server: KVServer) -> None:
    """The pool's check of a connection before reuse worked on descriptors below 1024
    only (select): vLLM raises the open-file limit, and every call then failed."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fillers = []
    try:
        with open(os.devnull) as f:
            while not fillers or fillers[-1] < 1100:
                fillers.append(os.dup(f.fileno()))
        with kvstore.Client(server.unix_url) as c:
            c.info()
            for _ in range(3):
                assert c.stats().chunks >= 0
            assert c.express is not None and c.express.calls == 3
            assert all(conn.fileno() >= 1024 for conn in c.express._idle), "not past 1023"
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
