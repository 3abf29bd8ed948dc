"""The express plane's listener: the servicer's unary methods over a second Unix socket.

``kvstore.express`` says why it exists and how frames look. Each connection gets a
thread that reads a frame, calls the servicer's method (wrapped by ``calls.rpc``, as
gRPC calls it: the same shutdown gate, counts, timing and error mapping) with a context
that carries the connection's metadata, and writes the reply. Calls on one connection
run in order; a client that wants several at once opens several connections (the SDK
keeps a pool), up to ``express_connections``.

Who may connect: whoever can reach the socket, which sits beside the gRPC Unix socket
in a directory ``main`` checked that only its user can change; the HELLO's bearer token
is checked as the gRPC interceptor checks it (``auth.TokenAuth.refusal``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvstore import express

from .streams import request_parser

log = logging.getLogger("kvstore.server.express")

# A refused connection's unread bytes are drained for this long, up to this many.
LINGER_S = 1.0
LINGER_BYTES = 4 << 20


def _whole(conn: socket.socket, n: int, deadline: float) -> bytes:
    data = express.recv_exact(conn, n, deadline)
    if data is None:
        raise ConnectionError("the peer closed the express socket within a frame")
    return data


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """The part of ``grpc.ServicerContext`` the servicer uses, for one express call."""

    def __init__(self, metadata: express.Metadata) -> None:
        self._metadata = metadata
        self.trailers: tuple[tuple[str, str | bytes], ...] = ()

    def invocation_metadata(self) -> express.Metadata:
        return self._metadata

    def is_active(self) -> bool:
        return True

    def set_trailing_metadata(self, trailers: Any) -> None:
        self.trailers = tuple(trailers)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def _unary_methods(service: Any) -> dict[str, tuple[Callable[[bytes], Any], Any]]:
    """name -> (request parser, servicer method) for every method the plane carries."""
    return {
        name: (request_parser(request), getattr(service, name))
        for name, (request, _) in express.METHODS.items()
    }


class ExpressPlane:
    """Listens on ``path`` until ``stop``; ``refusal(metadata)`` says why a HELLO may not
    connect (None: it may)."""

    def __init__(
        self,
        service: Any,
        path: str,
        *,
        refusal: Callable[[express.Metadata], str | None],
        max_frame: int,
        max_connections: int,
        max_calls: int,
        frame_timeout_s: float = 30.0,
    ) -> None:
        self.path = path
        # A connection's HELLO, and every later frame once its first byte is in, must
        # arrive whole within this: a client that stops mid-frame, or connects and never
        # says who it is (hung, hostile), does not keep its thread. Between frames a
        # connection may sit idle (its client's pool keeps it); at most max_connections,
        # past which clients use gRPC.
        self._frame_timeout_s = frame_timeout_s
        self._methods = _unary_methods(service)
        self._refusal = refusal
        self._max_frame = max_frame
        self._max_connections = max_connections
        # Calls served at once, as gRPC's max_concurrent_rpcs bounds its worker threads:
        # more wait for a turn.
        self._calls = threading.BoundedSemaphore(max_calls)
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closing = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self.inode = os.stat(path).st_ino
        self._thread = threading.Thread(target=self._accept, name="kvstore-express", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection and wait (up to ``timeout_s``) for the
        calls in flight on them to finish, then remove the socket file if it is still
        ours. The server calls it once its calls drained, before it closes the store."""
        with self._lock:
            self._closing = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=timeout_s)
        with self._lock:
            conns = dict(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RD)  # a call in flight still sends its reply
        deadline = time.monotonic() + timeout_s
        for t in conns.values():
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                refused = self._closing or len(self._conns) >= self._max_connections
                if not refused:
                    thread = threading.Thread(
                        target=self._serve, args=(conn,), name="kvstore-express-conn", daemon=True
                    )
                    self._conns[conn] = thread
            if refused:
                # Said at once, without waiting for the client's HELLO (no thread is spent
                # on it); the client makes its calls over gRPC instead.
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(
                        express.reply_frame(
                            grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                            express.error_body(
                                f"the server takes {self._max_connections} express "
                                "connections at most (express_connections); use gRPC"
                            ),
                        )
                    )
                conn.close()
                continue
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            metadata = self._hello(conn)
            while metadata is not None and self._call(conn, metadata):
                pass
        except (OSError, ConnectionError) as e:
            log.debug("express connection ended: %s", e)
        except Exception:  # never expected: the connection ends, the server goes on
            log.exception("express connection failed")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _read(self, conn: socket.socket, *, hello: bool = False) -> tuple[str, bytes, int] | None:
        """The next frame (name, body, flags); None at a clean end or a refused one. The
        HELLO is timed from the connection's start, a later frame from its first byte."""
        deadline = time.monotonic() + self._frame_timeout_s
        if hello:
            first = express.recv_exact(conn, 1, deadline)
        else:
            conn.settimeout(None)
            first = express.recv_exact(conn, 1)  # waits as long as the connection idles
            deadline = time.monotonic() + self._frame_timeout_s
        if first is None:
            return None
        head = first + _whole(conn, express.REQUEST.size - 1, deadline)
        size, name_len, flags = express.REQUEST.unpack(head)
        if size > self._max_frame:
            if not flags & express.NO_REPLY:  # a call not waited for gets no answer, ever
                self._fail(
                    conn,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a {size}-byte request; the server takes {self._max_frame} at most "
                    "(max_message_bytes)",
                )
            return None  # the rest of the frame is not read: the connection ends
        rest = _whole(conn, name_len + size, deadline)
        return rest[:name_len].decode("ascii", errors="replace"), rest[name_len:], flags

    def _hello(self, conn: socket.socket) -> express.Metadata | None:
        frame = self._read(conn, hello=True)
        if frame is None:
            return None
        name, body, _ = frame
        try:
            if name != express.HELLO:
                raise ValueError(f"the first call is {name!r}, not {express.HELLO}")
            metadata = express.parse_hello(body)
        except ValueError as e:
            self._fail(conn, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return None
        why = self._refusal(metadata)
        if why is not None:
            self._fail(conn, grpc.StatusCode.UNAUTHENTICATED, f"{why}; this server requires one")
            return None
        conn.sendall(express.reply_frame(0, b""))
        return metadata

    def _call(self, conn: socket.socket, metadata: express.Metadata) -> bool:
        """Serve one call; False when the connection ends."""
        frame = self._read(conn)
        if frame is None:
            return False
        name, body, flags = frame
        method = self._methods.get(name)
        if method is None:
            reply = express.reply_frame(
                grpc.StatusCode.UNIMPLEMENTED.value[0],
                express.error_body(f"{name}: not a unary method of the express plane"),
            )
        else:
            parse, handler = method
            context = _Context(metadata)
            try:
                with self._calls:
                    answer = handler(parse(body), context)
                reply = express.reply_frame(0, answer.SerializeToString())
            except _Aborted as e:
                reply = express.reply_frame(
                    e.code.value[0], express.error_body(e.details, context.trailers)
                )
        if not flags & express.NO_REPLY:
            conn.settimeout(self._frame_timeout_s)  # a client that stops reading
            conn.sendall(reply)
        return True

    def _fail(self, conn: socket.socket, code: grpc.StatusCode, details: str) -> None:
        """Answer with an error before the connection ends. What the client sent after it
        is read and dropped first (briefly): closing a socket with unread bytes resets
        it, and the client could lose the answer that says why."""
        with contextlib.suppress(OSError):
            conn.settimeout(LINGER_S)
            conn.sendall(express.reply_frame(code.value[0], express.error_body(details)))
            conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER_S
            left = LINGER_BYTES
            while (
                left > 0 and time.monotonic() < deadline and (got := conn.recv(min(left, 1 << 20)))
            ):
                left -= len(got)
