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
from collections.abc import Callable
from typing import Any

import grpc

from kvstore import express
from kvstore.v1 import kvstore_pb2 as pb

from .streams import request_parser

log = logging.getLogger("kvstore.server.express")

# A refused connection's unread bytes are drained for this long, up to this many.
LINGER_S = 1.0
LINGER_BYTES = 64 << 20


def _whole(conn: socket.socket, n: int) -> bytes:
    data = express.recv_exact(conn, n)
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
    """name -> (request parser, servicer method) for every unary-unary method."""
    out = {}
    for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods:
        if m.client_streaming or m.server_streaming:
            continue
        out[m.name] = (request_parser(getattr(pb, m.input_type.name)), getattr(service, m.name))
    return out


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
        frame_timeout_s: float = 30.0,
    ) -> None:
        self.path = path
        # Once a frame's header is in, the rest must follow within this: a client that
        # stops mid-frame (hung, hostile) does not hold its thread. Between frames a
        # connection may sit idle (its client's pool keeps it); those are bounded by
        # max_connections, past which clients use gRPC.
        self._frame_timeout_s = frame_timeout_s
        self._methods = _unary_methods(service)
        self._refusal = refusal
        self._max_frame = max_frame
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
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

    def stop(self) -> None:
        """Stop accepting, end every connection (a call in flight finishes its own reply
        or finds its socket gone) and remove the socket file if it is still ours."""
        with self._lock:
            self._closing = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5.0)
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
                    self._conns.add(conn)
            if refused:  # the client makes its calls over gRPC instead
                threading.Thread(target=self._refuse, args=(conn,), daemon=True).start()
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="kvstore-express-conn", daemon=True
            ).start()

    def _refuse(self, conn: socket.socket) -> None:
        self._fail(
            conn,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the server takes {self._max_connections} express connections at most "
            "(express_connections); use gRPC",
        )
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            metadata = self._hello(conn)
            while metadata is not None and self._call(conn, metadata):
                pass
        except (OSError, ConnectionError) as e:
            log.debug("express connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _read(self, conn: socket.socket) -> tuple[str, bytes, int] | None:
        """The next frame (name, body, flags); None at a clean end or a refused one."""
        first = express.recv_exact(conn, 1)  # waits as long as the connection idles
        if first is None:
            return None
        conn.settimeout(self._frame_timeout_s)
        try:
            head = first + _whole(conn, express.REQUEST.size - 1)
            size, name_len, flags = express.REQUEST.unpack(head)
            if size > self._max_frame:
                self._fail(
                    conn,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a {size}-byte request; the server takes {self._max_frame} at most "
                    "(max_message_bytes)",
                )
                return None  # the rest of the frame is not read: the connection ends
            rest = _whole(conn, name_len + size)
        finally:
            conn.settimeout(None)
        return rest[:name_len].decode("ascii", errors="replace"), rest[name_len:], flags

    def _hello(self, conn: socket.socket) -> express.Metadata | None:
        frame = self._read(conn)
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
                answer = handler(parse(body), context)
                reply = express.reply_frame(0, answer.SerializeToString())
            except _Aborted as e:
                reply = express.reply_frame(
                    e.code.value[0], express.error_body(e.details, context.trailers)
                )
        if not flags & express.NO_REPLY:
            conn.sendall(reply)
        return True

    def _fail(self, conn: socket.socket, code: grpc.StatusCode, details: str) -> None:
        """Answer with an error before the connection ends. What the client sent after it
        is read and dropped first (briefly): closing a socket with unread bytes resets
        it, and the client could lose the answer that says why."""
        with contextlib.suppress(OSError):
            conn.sendall(express.reply_frame(code.value[0], express.error_body(details)))
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(LINGER_S)
            left = LINGER_BYTES
            while left > 0 and (got := conn.recv(min(left, 1 << 20))):
                left -= len(got)
