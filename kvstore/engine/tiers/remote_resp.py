"""A minimal RESP2 client for the bulk values of L3: record bytes straight from the socket.

redis-py and valkey-py parse a bulk reply into a fresh ``bytes`` object, then the
tier copies it again; for a 64 MiB record that is two copies through a Python
parser, and a GET reaches 0.2-0.3 of what loopback TCP moves
(``benchmarks/remote_candidates.py`` measured every candidate). This client
speaks only what the record values need (``GET``, ``SET ... NX``, ``DEL``,
``ASKING``, ``AUTH``, ``SELECT``, ``PING``) and hands the bytes of a bulk reply
to a *sink* that receives them in place (``recv_into`` into the destination:
an arena page, the caller's buffer, one preallocated ``bytearray``). Values to
send go out as the caller's buffers, never joined.

Deadlines. Each call has one deadline (``timeout_s`` from its start), applied to
the socket as ``SO_RCVTIMEO``/``SO_SNDTIMEO`` before every system call with what
is left of it: the socket stays in blocking mode, so a 64 MiB reply arrives in a
few ``recv_into(MSG_WAITALL)`` calls instead of one poll and one copy per 64 KiB.
A call that runs past its deadline raises ``RespTimeoutError`` and the connection is
closed: a half-read reply leaves it out of step, so it is never reused.

Errors. A connection that fails or times out raises ``RespConnectionError`` (a
``ConnectionError``, so an ``OSError``: the tier counts it as the remote being
down); an error reply raises ``RespError`` (``RespOOM`` for ``OOM``), with the
reply's first word in ``word`` (``MOVED``/``ASK`` redirect cluster calls, see
``kvstore.engine.tiers.remote_fast``).

Connections live in a ``RespPool`` per server address, shared by threads: a call
takes an idle connection (or opens one) and gives it back when the reply was
read whole.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")

BUF_BYTES = 64 * 1024  # the reader's own buffer, for reply lines and small values
SMALL = 16 * 1024  # parts up to this size are coalesced into one send
MAX_IDLE = 16  # idle connections kept per address; more are closed when given back
_CRLF = b"\r\n"


class RespConnectionError(ConnectionError):
    """The server could not be reached, went away, or spoke out of step."""


class RespTimeoutError(RespConnectionError, TimeoutError):
    """A call ran past its deadline."""


class RespError(Exception):
    """An error reply from the server (``-ERR ...``): it answered, and refused."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.word = text.split(" ", 1)[0]


class RespOOM(RespError):
    """``OOM``: maxmemory reached with a noeviction policy."""


class Reader(Protocol):
    """What a bulk sink reads the value's bytes with; it must read exactly the value."""

    def read_into(self, view: memoryview) -> None: ...


Sink = Callable[[int, Reader], T]
Arg = str | bytes | memoryview | tuple[bytes | memoryview, ...]
"""Called with the length of a bulk reply and a reader; returns the call's result."""


class RespConnection:
    """One socket to one server; not thread-safe (the pool hands it to one caller at once)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
    ) -> None:
        self.address = (host, port)
        self._deadline = time.monotonic() + connect_timeout_s
        try:
            self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except OSError as e:
            raise RespConnectionError(f"cannot connect to {host}:{port}: {e}") from e
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(None)  # blocking; the deadline is SO_RCVTIMEO/SO_SNDTIMEO
        self._set_for = -1.0
        self._buf = bytearray(BUF_BYTES)
        self._view = memoryview(self._buf)
        self._r = self._w = 0  # unread bytes are _buf[_r:_w]
        self.broken = False
        try:
            if password is not None:
                auth = ("AUTH", username, password) if username else ("AUTH", password)
                self.call(auth, connect_timeout_s)
            if db:
                self.call(("SELECT", str(db)), connect_timeout_s)
        except BaseException:
            self.close()
            raise

    # -- deadlines ----------------------------------------------------------------
    def _arm(self) -> None:
        """Give the next system call what is left of the deadline (at least 1 ms)."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise RespTimeoutError(f"{self._name()}: deadline passed")
        if abs(left - self._set_for) < 0.002:  # close enough: spare two system calls
            return
        sec = int(left)
        usec = int((left - sec) * 1e6)
        tv = struct.pack("ll", sec, usec if sec else max(1000, usec))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._set_for = left

    def _name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    # -- sending ----------------------------------------------------------------------
    def _send(self, parts: Sequence[bytes | memoryview]) -> None:
        small = bytearray()
        try:
            for part in parts:
                if len(part) <= SMALL:
                    small += part
                    continue
                if small:
                    self._arm()
                    self._sock.sendall(small)
                    small = bytearray()
                self._arm()
                self._sock.sendall(part)
            if small:
                self._arm()
                self._sock.sendall(small)
        except BlockingIOError as e:  # SO_SNDTIMEO ran out
            raise RespTimeoutError(f"{self._name()}: send timed out") from e
        except OSError as e:
            raise RespConnectionError(f"{self._name()}: send failed: {e}") from e

    # -- receiving ----------------------------------------------------------------------
    def _fill(self) -> None:
        """Read more into the buffer (compacting it first); at least one byte or raise."""
        if self._r == self._w:
            self._r = self._w = 0
        elif self._w == len(self._buf):
            n = self._w - self._r
            self._buf[:n] = self._buf[self._r : self._w]
            self._r, self._w = 0, n
        self._arm()
        try:
            got = self._sock.recv_into(self._view[self._w :])
        except BlockingIOError as e:  # SO_RCVTIMEO ran out
            raise RespTimeoutError(f"{self._name()}: no reply in time") from e
        except OSError as e:
            raise RespConnectionError(f"{self._name()}: receive failed: {e}") from e
        if not got:
            raise RespConnectionError(f"{self._name()}: the server closed the connection")
        self._w += got

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(_CRLF, self._r, self._w)
            if end >= 0:
                line = bytes(self._view[self._r : end])
                self._r = end + 2
                return line
            if self._w - self._r >= len(self._buf) - 2:
                raise RespConnectionError(
                    f"{self._name()}: reply line longer than {len(self._buf)} bytes"
                )
            self._fill()

    def read_into(self, view: memoryview) -> None:
        """Exactly ``len(view)`` bytes: first what is buffered, then straight from the socket."""
        need = len(view)
        have = min(need, self._w - self._r)
        if have:
            view[:have] = self._view[self._r : self._r + have]
            self._r += have
        got = have
        while got < need:
            self._arm()
            try:
                n = self._sock.recv_into(view[got:], need - got, socket.MSG_WAITALL)
            except BlockingIOError as e:
                raise RespTimeoutError(f"{self._name()}: value not received in time") from e
            except OSError as e:
                raise RespConnectionError(f"{self._name()}: receive failed: {e}") from e
            if not n:
                raise RespConnectionError(f"{self._name()}: the server closed the connection")
            got += n

    def _end_bulk(self) -> None:
        while self._w - self._r < 2:
            self._fill()
        if self._view[self._r : self._r + 2] != _CRLF:
            raise RespConnectionError(f"{self._name()}: bulk reply not terminated by CRLF")
        self._r += 2

    def _reply(self, sink: Sink[T] | None = None, *, top: bool = False) -> object:
        """One reply. Only a top-level error reply leaves the connection in step."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            text = rest.decode("utf-8", "replace")
            self.broken = self.broken or not top
            raise (RespOOM if text.startswith("OOM") else RespError)(text)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            if sink is not None:
                out = sink(n, self)
                self._end_bulk()
                return out
            data = bytearray(n)
            self.read_into(memoryview(data))
            self._end_bulk()
            return bytes(data)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise RespConnectionError(f"{self._name()}: unexpected reply {line[:40]!r}")

    # -- calls --------------------------------------------------------------------------
    def call(
        self,
        args: Sequence[Arg | None],
        timeout_s: float,
        sink: Sink[T] | None = None,
        *,
        prefix: Sequence[Sequence[Arg]] = (),
    ) -> object:
        """Send one command (after ``prefix`` commands, whose replies must be OK) and
        return its reply; a bulk reply goes to ``sink`` when given.

        An error reply raises RespError and leaves the connection usable; anything
        else that goes wrong (including the sink raising) breaks it.
        """
        self._deadline = time.monotonic() + timeout_s
        try:
            wire: list[bytes | memoryview] = []
            for cmd in (*prefix, [a for a in args if a is not None]):
                _pack(wire, cmd)
            self._send(wire)
            for _ in prefix:
                self._reply()  # an error here leaves the command's reply unread: broken
            return self._reply(sink, top=True)
        except RespError:
            raise  # self.broken says whether the connection is still in step
        except BaseException:
            self.broken = True
            raise

    def pipeline(
        self,
        cmds: Sequence[tuple[Sequence[str | bytes | memoryview], Sink[T] | None]],
        timeout_s: float,
    ) -> list[object]:
        """Several commands in one round trip; each reply in order, an error reply as its
        RespError (the others still read, the connection in step)."""
        self._deadline = time.monotonic() + timeout_s
        try:
            wire: list[bytes | memoryview] = []
            for args, _ in cmds:
                _pack(wire, args)
            self._send(wire)
            out: list[object] = []
            for _, sink in cmds:
                try:
                    out.append(self._reply(sink, top=True))
                except RespError as e:
                    if self.broken:
                        raise
                    out.append(e)
            return out
        except BaseException:
            self.broken = True
            raise

    def stream(
        self,
        cmds: Sequence[tuple[Sequence[Arg], Sink[T] | None]],
        timeout_s: float,
        window: int,
    ) -> list[object]:
        """Like ``pipeline``, with at most ``window`` commands in flight: the server holds
        at most that many replies at once (big values: its reply buffers stay few)."""
        self._deadline = time.monotonic() + timeout_s
        out: list[object] = []
        try:
            sent = 0
            while len(out) < len(cmds):
                if sent < len(cmds) and sent - len(out) < window:
                    wire: list[bytes | memoryview] = []
                    upto = min(len(cmds), len(out) + window)
                    for args, _ in cmds[sent:upto]:
                        _pack(wire, args)
                    self._send(wire)
                    sent = upto
                try:
                    out.append(self._reply(cmds[len(out)][1], top=True))
                except RespError as e:
                    if self.broken:
                        raise
                    out.append(e)
            return out
        except BaseException:
            self.broken = True
            raise

    def close(self) -> None:
        self.broken = True
        try:
            self._sock.close()
        except OSError:
            pass


def _pack(wire: list[bytes | memoryview], args: Sequence[Arg]) -> None:
    """Append one command's RESP encoding; buffers are referenced, not copied. A tuple of
    buffers is one argument: their concatenation, never built."""
    wire.append(b"*%d\r\n" % len(args))
    for a in args:
        parts = a if isinstance(a, tuple) else (a,)
        views = [_bytes_view(p) for p in parts]
        wire.append(b"$%d\r\n" % sum(len(v) for v in views))
        wire += views
        wire.append(_CRLF)


def _bytes_view(data: str | bytes | memoryview) -> bytes | memoryview:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, memoryview) and (data.ndim != 1 or data.itemsize != 1):
        return data.cast("B")  # lengths are in bytes
    return data


class RespPool:
    """Idle connections to one address, shared by threads."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
    ) -> None:
        self.host, self.port = host, port
        self._opts = {
            "connect_timeout_s": connect_timeout_s,
            "username": username,
            "password": password,
            "db": db,
        }
        self._idle: list[RespConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def run(self, fn: Callable[[RespConnection], T]) -> T:
        """``fn(connection)`` on an idle (or new) connection, given back unless it broke."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = RespConnection(self.host, self.port, **self._opts)  # type: ignore[arg-type]
        try:
            return fn(conn)
        finally:
            self._give_back(conn)

    def _give_back(self, conn: RespConnection) -> None:
        if not conn.broken:
            with self._lock:
                if not self._closed and len(self._idle) < MAX_IDLE:
                    self._idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
