"""The blocking client's express link: its unary calls over the server's express socket.

``kvstore.express`` says what the express plane is and why. A link keeps a pool of
connections to one server's express socket (a call takes one for its round trip, so
threads of one client call at once), each opened with a HELLO carrying the client's
metadata. What it may not do, it says by returning ``FALLBACK``, and the client makes
the call over gRPC instead: when the socket is not there or refuses the connection
(no express plane, a server restarting, ``express_connections`` reached), or when a
pooled connection was found dead before the request went out. Once a request is out,
a lost connection is the call's failure (``ServerUnavailable``: the server may have
done it), as a broken gRPC call's is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
import weakref
from collections import deque
from typing import Any, Final

import grpc

from kvstore import express
from kvstore.clock import Clock, monotonic
from kvstore.errors import KVStoreError
from kvstore.protocol import ERROR_REASON_HEADER
from kvstore.sdk.wire import error_from_code, error_from_status

log = logging.getLogger("kvstore.sdk")

FALLBACK: Final = object()  # ``call``'s answer when the call must go by gRPC
RETRY_S: Final = 1.0  # after a connection was refused, gRPC alone for this long


class ExpressLink:
    """Calls to the express socket at ``path`` with ``metadata`` (auth, session id)."""

    def __init__(
        self,
        path: str,
        metadata: express.Metadata,
        target: str,
        *,
        clock: Clock = monotonic,
    ) -> None:
        self.path = path
        self._hello = express.request_frame(express.HELLO, express.hello_body(metadata))
        self._target = target  # named in errors
        self._clock = clock  # when a refused plane is tried again
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._down_until = 0.0
        self._closed = False
        self.calls = 0  # calls this link carried (its tests and benchmarks read it)
        _LINKS.add(self)

    def call(self, method: str, request: Any, deadline: float) -> Any:
        """``method``'s reply, its error raised, or FALLBACK (also for a method the express
        plane does not carry: a streaming one). ``deadline`` (``time.monotonic()``) bounds
        the whole call, a connection made for it included; what is left of it after a
        FALLBACK is the gRPC call's."""
        if method not in express.METHODS:
            return FALLBACK
        conn = self._take(deadline)
        if conn is None:
            return FALLBACK
        frame = express.request_frame(method, request.SerializeToString())
        try:
            try:
                conn.settimeout(_left(deadline))
                conn.sendall(frame)
            except OSError:
                # Not all of it went out: the server never read a whole request.
                conn.close()
                return FALLBACK
            code, body = _reply(conn, method, deadline)
        except OSError as e:  # TimeoutError and ConnectionError included
            conn.close()
            raise self._lost(method, e) from e
        self._give(conn)
        return self._answer(method, code, body)

    def _lost(self, method: str, e: OSError) -> KVStoreError:
        """The error of a call whose connection failed after its request went out (the
        server may have done it): its deadline passed, or the socket broke."""
        if isinstance(e, TimeoutError):
            return self._error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", method)
        return self._error(grpc.StatusCode.UNAVAILABLE, f"express socket: {e}", method)

    def _answer(self, method: str, code: int, body: bytes) -> Any:
        """A reply's message, or its error raised."""
        if code == 0:
            return express.METHODS[method][1].FromString(body)
        details, trailers = express.parse_error(body)
        reason = next((v for k, v in trailers if k == ERROR_REASON_HEADER), "")
        raise error_from_code(code, details, method, self._target, reason=reason)

    def pipe(self, deadline: float) -> ExpressPipe | None:
        """A connection of the pool for a pipe's calls (``ExpressPipe``); None when gRPC
        must carry them."""
        conn = self._take(deadline)
        return ExpressPipe(self, conn) if conn is not None else None

    def send(self, method: str, request: Any) -> bool:
        """Send a call whose answer nobody waits for (a Release) on a connection of the
        pool; False if there is none idle or it did not go (the caller sends it by gRPC,
        also without waiting: this never dials nor waits for a stalled server)."""
        conn = self._take(None)
        if conn is None:
            return False
        try:
            conn.setblocking(False)
            body = request.SerializeToString()
            frame = express.request_frame(method, body, express.NO_REPLY)
            if conn.send(frame) != len(frame):
                raise BlockingIOError("the socket's buffer is full")
        except OSError:
            # A part may have gone out: the connection can carry nothing more.
            conn.close()
            return False
        self._give(conn)
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- connections -----------------------------------------------------------------------
    def _take(self, deadline: float | None) -> socket.socket | None:
        """A live connection, or None when gRPC must carry the call. Without a deadline
        only one of the pool (no dialing)."""
        while True:
            with self._lock:
                if self._closed:
                    raise KVStoreError("the client is closed")
                conn = self._idle.pop() if self._idle else None
                if conn is None and (deadline is None or self._clock() < self._down_until):
                    return None
            if conn is None:
                assert deadline is not None
                return self._connect(deadline)
            # A pooled connection the server ended (a restart, its shutdown) reads as
            # ready: an end of file, or a refusal it sent. Such a one is let go unused.
            poller = select.poll()  # not select(): descriptors past 1023 are common
            poller.register(conn, select.POLLIN)
            if not poller.poll(0):
                return conn
            conn.close()

    def _give(self, conn: socket.socket, calls: int = 1) -> None:
        """Back to the pool after the calls it carried."""
        with self._lock:
            self.calls += calls
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self, deadline: float) -> socket.socket | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(_left(deadline))
            conn.connect(self.path)
            conn.sendall(self._hello)
            code, body = _reply(conn, express.HELLO, deadline)
        except (OSError, ConnectionError) as e:
            conn.close()
            self._down(f"cannot connect: {e}")
            return None
        if code != 0:
            conn.close()
            details, _ = express.parse_error(body)
            if code == grpc.StatusCode.UNAUTHENTICATED.value[0]:
                raise error_from_status(
                    grpc.StatusCode.UNAUTHENTICATED, details, "express plane", self._target
                )
            self._down(details)
            return None
        return conn

    def _down(self, why: str) -> None:
        log.debug("express plane %s not used for %.0f s: %s", self.path, RETRY_S, why)
        with self._lock:
            self._down_until = self._clock() + RETRY_S

    def _error(self, code: grpc.StatusCode, details: str, method: str) -> KVStoreError:
        return error_from_status(code, details, method, self._target)

    def _forked(self) -> None:
        """In a forked child: the pooled sockets are its parent's connections too, and two
        processes writing frames on one would mix them (each reading the other's
        answers). The child closes its copies (the parent's stay open) and dials its own;
        the lock is new, as another thread of the parent may have held it at the fork."""
        self._lock = threading.Lock()
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class ExpressPipe:
    """A pipe's calls (``client_core.Pipe``) on one connection: each request written as
    it is sent, the replies read in the same order (the server serves a connection's
    calls one after another). ``end`` gives the connection back once every reply was
    read; otherwise it is closed, as an unread reply would be taken for the next call's.

    Several requests go out before their replies are read, so the replies can fill this
    end's buffer: the server then blocks writing one and reads no more of the request
    being written here, which blocks too (a batch of 5,000 reservations did, until the
    server's frame timeout). So while the socket takes no more of a request, the replies
    already on their way are read and kept for ``receive``."""

    def __init__(self, link: ExpressLink, conn: socket.socket) -> None:
        self._link, self._conn = link, conn
        # (method, timeout) of each call sent whose reply was not taken, in order. A
        # reply is waited for up to its call's timeout from when ``receive`` asks for it:
        # a pipe's plan works between its calls (copies), and a reply that came while it
        # did is not late.
        self._waiting: deque[tuple[str, float]] = deque()
        self._early: deque[tuple[int, bytes]] = deque()  # replies of _waiting's first ones
        self._sent = 0  # calls sent
        self._wrote = 0  # bytes of the request being sent that went out
        self._broken = False

    def send(self, method: str, request: Any, timeout: float) -> bool:
        """Write the call; False if the first call of the pipe found the connection dead
        (nothing went out: gRPC carries the pipe instead)."""
        self._check_live(method)
        if method not in express.METHODS:
            raise TypeError(f"{method} is not a unary method of the express plane")
        deadline = time.monotonic() + timeout
        frame = express.request_frame(method, request.SerializeToString())
        self._wrote = 0
        try:
            self._write(memoryview(frame), deadline)
        except OSError as e:  # TimeoutError and ConnectionError included
            self._break()
            if not self._sent and not self._wrote and not isinstance(e, TimeoutError):
                return False
            raise self._link._lost(method, e) from e
        self._sent += 1
        self._waiting.append((method, timeout))
        return True

    def _write(self, view: memoryview, deadline: float) -> None:
        conn = self._conn
        poller = select.poll()
        poller.register(conn, select.POLLIN | select.POLLOUT)
        conn.setblocking(False)
        while self._wrote < len(view):
            try:
                self._wrote += conn.send(view[self._wrote :])
                continue
            except BlockingIOError:
                pass
            events = poller.poll(int(_left(deadline) * 1000) + 1)
            if not events:
                raise TimeoutError("the socket took no more of the request by the deadline")
            if any(ev & (select.POLLIN | select.POLLHUP | select.POLLERR) for _, ev in events):
                if len(self._early) == len(self._waiting):
                    raise ConnectionError("the server ended the express connection")
                method = self._waiting[len(self._early)][0]
                self._early.append(_reply(conn, method, deadline))
                conn.setblocking(False)  # _reply left it blocking, with a timeout

    def receive(self) -> Any:
        method, timeout = self._waiting.popleft()
        if self._early:
            return self._link._answer(method, *self._early.popleft())
        self._check_live(method)
        try:
            code, body = _reply(self._conn, method, time.monotonic() + timeout)
        except OSError as e:  # TimeoutError and ConnectionError included
            self._break()
            raise self._link._lost(method, e) from e
        return self._link._answer(method, code, body)

    def end(self) -> None:
        if self._waiting or self._broken:
            self._waiting.clear()
            self._early.clear()
            self._conn.close()
        else:
            self._link._give(self._conn, self._sent)

    def _break(self) -> None:
        """The connection carries nothing more: a part of a frame may be on it."""
        self._broken = True
        self._conn.close()

    def _check_live(self, method: str) -> None:
        if self._broken:
            raise self._link._error(
                grpc.StatusCode.UNAVAILABLE, "express socket: an earlier call failed", method
            )


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left


def _reply(conn: socket.socket, method: str, deadline: float) -> tuple[int, bytes]:
    head = express.recv_exact(conn, express.REPLY.size, deadline)
    if head is None:
        raise ConnectionError(f"the server closed the express socket before answering {method}")
    size, code, _ = express.REPLY.unpack(head)
    body = express.recv_exact(conn, size, deadline)
    if body is None:
        raise ConnectionError(f"the server closed the express socket within {method}'s answer")
    return code, body


_LINKS: weakref.WeakSet[ExpressLink] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for link in list(_LINKS):
        link._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
