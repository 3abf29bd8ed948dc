"""Idle links: clients that stay quiet past the server's idle timeout, or behind a middlebox
that drops quiet connections, and then call again.

The seed's TorchDistributedPipe died when producer and consumer sat idle for a while (no
heartbeat). kvstore's clients ping every 30 s with calls or without (gRPC keepalive,
``kvstore.sdk.base.CHANNEL_OPTIONS``), and the server takes pings once a second and closes
connections idle past ``idle_timeout_s``. Scaled down here: the tests keep the SDK's
options and shorten only its ping interval (the server's policy is the real one), so a
release that drops the keepalive options fails them.

- A client (the SDK's ``Client`` and the connector's ``BreakerClient``) idle past a 1 s
  server idle timeout: the server closes its connection (seen as the channel going IDLE),
  and the next gets, puts and lookups all succeed.
- Through a TCP relay that forgets connections quiet for 3 s, as NATs and load
  balancers do (bytes go in and nothing comes out, nothing is reset): with keepalive the
  link is never quiet and calls after 5 s of idleness succeed; without it (the control)
  the first call after the idleness waits out its deadline.
- The relay freezes every connection at once (a NAT that restarted): keepalive finds the
  dead connection and the next call dials a new one.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

import kvstore
import kvstore.sdk.base
from kvstore.errors import ConfigError, DeadlineExceeded, KVStoreError
from kvstore.keys import ROOT, Namespace
from kvstore.testing.ports import free_port
from kvstore.testing.server import KVServer

SERVER_ARGS = ["--chunk-tokens", "16", "--granularity", "4", "--log-level", "warning"]
PING_MS = 1500  # the tests' keepalive interval: above the server's 1 s floor
RELAY_FORGETS_S = 3.0  # a relay's connection quiet this long is forgotten
IDLE_S = 5.0  # how long the clients sit quiet: past RELAY_FORGETS_S, and past 3 pings
CALL_S = 2.0  # deadline of every call after the idleness


def scaled_options(keepalive: bool) -> list[tuple[str, Any]]:
    """The SDK's channel options with its ping interval shortened (keepalive=True), or
    without any keepalive option (the control)."""
    out = []
    for k, v in kvstore.sdk.base.CHANNEL_OPTIONS:
        if not keepalive and ("ping" in k or "keepalive" in k):
            continue
        if k == "grpc.keepalive_time_ms":
            v = PING_MS
        elif k in ("grpc.keepalive_timeout_ms", "grpc.http2.ping_timeout_ms"):
            v = 1000
        out.append((k, v))
    return out


class Relay:
    """A TCP relay to ``target`` on a free loopback port that forgets a connection quiet
    for ``forget_s`` (or all of them at ``freeze()``): it stops moving its bytes both ways
    and keeps its sockets open, as a NAT or load balancer that dropped its entry does."""

    def __init__(self, target: tuple[str, int], forget_s: float) -> None:
        self.target, self.forget_s = target, forget_s
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._peer: dict[socket.socket, socket.socket] = {}
        self._last: dict[socket.socket, float] = {}  # per connection (client side)
        self._side: dict[socket.socket, socket.socket] = {}  # either socket -> client side
        self._forgotten: list[socket.socket] = []
        self.forgotten = 0
        self._freeze = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def freeze(self) -> None:
        self._freeze.set()

    def _forget(self, client: socket.socket) -> None:
        server = self._peer[client]
        for s in (client, server):
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(s)
            self._side.pop(s, None)
            self._forgotten.append(s)  # open, unread: the peer's bytes go nowhere
        self._last.pop(client, None)
        self.forgotten += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    with contextlib.suppress(BlockingIOError):
                        client, _ = self._listener.accept()
                        server = socket.create_connection(self.target)
                        for s in (client, server):
                            s.setblocking(False)
                            self._sel.register(s, selectors.EVENT_READ)
                            self._side[s] = client
                        self._peer[client], self._peer[server] = server, client
                        self._last[client] = time.monotonic()
                    continue
                owner = self._side.get(sock)
                if owner is None:
                    continue
                try:
                    data = sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    data = b""
                if not data:  # a real close travels on
                    other = self._peer[sock]
                    for s in (sock, other):
                        with contextlib.suppress(KeyError, ValueError):
                            self._sel.unregister(s)
                        self._side.pop(s, None)
                        s.close()
                    self._last.pop(owner, None)
                    continue
                self._peer[sock].setblocking(True)
                self._peer[sock].sendall(data)
                self._peer[sock].setblocking(False)
                self._last[owner] = time.monotonic()
            now = time.monotonic()
            frozen = self._freeze.is_set()
            for client, last in list(self._last.items()):
                if frozen or now - last > self.forget_s:
                    self._forget(client)
            self._freeze.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in [*self._peer, *self._forgotten, self._listener]:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def srv(make_server: Callable[..., KVServer]) -> Iterator[KVServer]:
    s = make_server("idle", args=[*SERVER_ARGS, "--idle-timeout", "1"]).start()
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture
def quiet_srv(make_server: Callable[..., KVServer]) -> Iterator[KVServer]:
    """A server that keeps quiet connections (its own idle timeout would close them before
    a relay could forget them)."""
    s = make_server("quiet", args=[*SERVER_ARGS, "--idle-timeout", "0"]).start()
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture
def relay(quiet_srv: KVServer) -> Iterator[Relay]:
    r = Relay(("127.0.0.1", quiet_srv.port), RELAY_FORGETS_S)
    yield r
    r.close()


NS = Namespace(model="idle-links", dtype="bfloat16", layout="test")


def _tokens(i: int) -> np.ndarray:
    return np.arange(16, dtype=np.uint32) + 16 * i


def _payload(i: int) -> np.ndarray:
    return np.full(16 * 32, i, dtype=np.uint16)


def _round(kv: kvstore.Client, i: int) -> tuple[int, int]:
    """Put chunk i, read it back byte for byte and look it up: (calls made, calls that
    failed or answered wrong)."""
    try:
        key, _ = kv.put_chunk(
            NS, ROOT, _tokens(i), _payload(i), "bfloat16", (16, 32), timeout=CALL_S
        )
    except KVStoreError:
        return 1, 1
    bad = 0
    try:
        got = kv.get(key, timeout=CALL_S)
        bad += got is None or bytes(got[1]) != _payload(i).tobytes()
    except KVStoreError:
        bad += 1
    try:
        bad += kv.lookup(NS, list(_tokens(i)), timeout=CALL_S).matched_tokens != 16
    except KVStoreError:
        bad += 1
    return 3, bad


def _watch_idle(channel: grpc.Channel) -> list[grpc.ChannelConnectivity]:
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append, try_to_connect=False)
    return states


def test_client_idle_past_the_server_idle_timeout(
    srv: KVServer, monkeypatch: pytest.MonkeyPatch, record: Callable[..., Any]
) -> None:
    monkeypatch.setattr(kvstore.sdk.base, "CHANNEL_OPTIONS", scaled_options(True))
    calls = bad = 0
    with kvstore.Client(srv.tcp_url, shm=False, timeout=CALL_S) as kv:
        c, b = _round(kv, 0)
        calls, bad = calls + c, bad + b
        states = _watch_idle(kv._channel)
        time.sleep(2.5)  # 2.5 x the server's idle timeout
        closed = grpc.ChannelConnectivity.IDLE in states
        for i in (1, 2):
            c, b = _round(kv, i)
            calls, bad = calls + c, bad + b
    record(
        "Clients",
        "a client idle past the server's idle timeout",
        "server with --idle-timeout 1; a gRPC client (keepalive on) puts, gets and looks up, "
        "sits quiet 2.5 s (the server closes its connection), then does it twice more",
        faults=1,
        requests=calls,
        lost=bad,
        notes=f"channel states while idle: {[s.name for s in states]}",
    )
    assert closed, f"the server did not close the idle connection: states {states}\n{srv.log()}"
    assert bad == 0, f"{bad} of {calls} calls failed after the idle timeout\n{srv.log()}"


def test_breaker_client_idle_past_the_server_idle_timeout(
    srv: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connector's client: no failure, its breaker stays closed."""
    pytest.importorskip("vllm")
    from kvstore.connectors.vllm_client import BreakerClient
    from kvstore.connectors.vllm_config import ConnectorConfig

    monkeypatch.setattr(kvstore.sdk.base, "CHANNEL_OPTIONS", scaled_options(True))
    cfg = ConnectorConfig(url=srv.tcp_url, shm="off", timeout_ms=int(CALL_S * 1000))
    bc = BreakerClient(cfg, cfg.url, role="scheduler")
    with kvstore.Client(srv.tcp_url, shm=False) as kv:
        kv.put_chunk(NS, ROOT, _tokens(7), _payload(7), "bfloat16", (16, 32))
    try:
        first = bc.lookup(NS, list(_tokens(7)), min_tokens=0, granularity=4)
        time.sleep(2.5)
        again = [bc.lookup(NS, list(_tokens(7)), min_tokens=0, granularity=4) for _ in range(3)]
        errors = bc.take_errors()
        state = bc.breaker.state
    finally:
        bc.close()
    assert first is not None and first.matched_tokens == 16, first
    assert all(r is not None and r.matched_tokens == 16 for r in again), (again, srv.log())
    assert errors == 0 and state.name == "CLOSED", (errors, state)


@pytest.mark.parametrize("keepalive", [True, False], ids=["keepalive", "control-without"])
def test_client_behind_a_relay_that_forgets_quiet_connections(
    relay: Relay,
    quiet_srv: KVServer,
    keepalive: bool,
    monkeypatch: pytest.MonkeyPatch,
    record: Callable[..., Any],
) -> None:
    monkeypatch.setattr(kvstore.sdk.base, "CHANNEL_OPTIONS", scaled_options(keepalive))
    with kvstore.Client(relay.url, shm=False, timeout=CALL_S) as kv:
        calls, bad = _round(kv, 0)
        states = _watch_idle(kv._channel)
        time.sleep(IDLE_S)
        kept = [s.name for s in states]
        t0 = time.monotonic()
        try:
            kv.lookup(NS, list(_tokens(0)), timeout=CALL_S)
            after, failed = 1, 0
        except DeadlineExceeded:
            after, failed = 1, 1
        waited = time.monotonic() - t0
        c, b = _round(kv, 1) if not failed else (0, 0)
    if keepalive:
        record(
            "Clients",
            "a client behind a relay that forgets quiet connections",
            f"TCP relay dropping connections quiet for {RELAY_FORGETS_S:.0f} s (bytes in, "
            f"nothing out, no reset); a gRPC client idle {IDLE_S:.0f} s, then calls again",
            faults=1,
            requests=calls + after + c,
            lost=bad + failed + b,
            notes=f"connections the relay forgot: {relay.forgotten}; first call after "
            f"the idleness {waited * 1000:.0f} ms",
        )
        # The same connection throughout: not forgotten by the relay, and not closed by the
        # server either (a GOAWAY for pinging too often would also let the next call work).
        assert kept == ["READY"], f"the connection did not stay up while idle: {kept}"
        assert relay.forgotten == 0, "keepalive did not keep the link busy"
        assert bad + failed + b == 0, f"calls failed after the idleness\n{quiet_srv.log()}"
    else:
        # The control: the relay does what it is meant to, and the call waits out its deadline.
        assert relay.forgotten >= 1, "the relay forgot no connection: it emulates nothing"
        assert failed, "the first call after the idleness got through without keepalive"


def test_client_whose_relay_freezes_every_connection(
    relay: Relay, quiet_srv: KVServer, monkeypatch: pytest.MonkeyPatch, record: Callable[..., Any]
) -> None:
    monkeypatch.setattr(kvstore.sdk.base, "CHANNEL_OPTIONS", scaled_options(True))
    with kvstore.Client(relay.url, shm=False, timeout=CALL_S) as kv:
        calls, bad = _round(kv, 0)
        relay.freeze()
        time.sleep(PING_MS / 1000 + 1.0 + 3.0)  # a ping, its 1 s timeout, room on a busy machine
        c, b = _round(kv, 1)
    record(
        "Clients",
        "a client whose relay froze its connection",
        "TCP relay stops moving the bytes of every open connection (a NAT that restarted); "
        "the gRPC client's keepalive finds it, the next calls dial a new connection",
        faults=1,
        requests=calls + c,
        lost=bad + b,
        notes=f"connections the relay forgot: {relay.forgotten}",
    )
    assert relay.forgotten >= 1
    assert bad + b == 0, f"{bad + b} calls failed after the relay froze\n{quiet_srv.log()}"


def test_idle_timeout_is_validated() -> None:
    from kvstore.server.config import ServerConfig

    assert ServerConfig(idle_timeout_s=0).idle_timeout_s == 0
    assert ServerConfig().idle_timeout_s == 600
    with pytest.raises(ConfigError, match=r"idle_timeout_s=0.5: must be 0 \(never\) or at least 1"):
        ServerConfig(idle_timeout_s=0.5)
