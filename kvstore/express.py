"""The express plane: the server's unary calls over a same-host Unix socket, without gRPC.

Why it exists: a gRPC unary call in Python costs ~0.5 ms at p50 and ~1.7 ms at p99 on a
2-core host, whatever it carries (HTTP/2 framing, grpcio's completion queue and its
threads contending for the GIL on both ends), while a round trip over a plain Unix
socket costs ~0.02 / 0.05 ms. A step of the vLLM connector makes a few calls (Lookup,
AcquireMany, Release, ReserveMany, CommitMany): over gRPC their round trips cost more
than copying a step's worth of 1 MiB chunks, and a 128k-token Lookup's p99 is the
call's, not the server's walk. The express plane carries the same request and response
messages (the .proto's) to the same servicer methods, so what a call means, checks and
answers is defined once; only the transport differs.

Both ends import this module (the framing); ``server.express`` listens,
``kvstore.sdk.express`` dials. Frames, little-endian:

- request: ``REQUEST`` (body length, method name length, flags), the method's name
  (ASCII, e.g. ``Lookup``), then the request message. ``NO_REPLY`` in flags: the server
  answers nothing (a Release sent without waiting). The first frame of a connection is
  ``HELLO``, whose body is ``hello_body``: the version and the call metadata
  (``authorization``, ``x-kvstore-session``) every later call on it carries.
- reply: ``REPLY`` (body length, status, 0), then the response message when the status
  is 0 (gRPC's OK), else ``error_body``: the message and trailing metadata a gRPC
  status would carry, so that the client reads it back into the same error.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Sequence
from typing import Final

from kvstore.v1 import kvstore_pb2 as pb

REQUEST: Final = struct.Struct("<IBB")  # body bytes, method name bytes, flags
REPLY: Final = struct.Struct("<IBB")  # body bytes, status code (gRPC's numbers), unused
NO_REPLY: Final = 1  # request flag: the server sends no reply
HELLO: Final = "Hello"  # the first call of a connection: its metadata
VERSION: Final = 1
SUFFIX: Final = ".express"  # the express socket's path: the gRPC Unix socket's and this
MAX_PATH: Final = 103  # bytes of a Unix socket's path (sun_path, NUL excluded), on any OS

Metadata = tuple[tuple[str, str], ...]

# The methods the plane carries, each with its request and response message: every
# unary method of the service (the streams, Put, Get and Session, stay on gRPC).
METHODS: Final = {
    m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name))
    for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods
    if not (m.client_streaming or m.server_streaming)
}


def socket_path(unix_socket: str) -> str:
    """Where a server listening on ``unix_socket`` offers the express plane ("" if the
    name would not fit a Unix socket's path)."""
    path = unix_socket + SUFFIX
    return path if len(path.encode()) <= MAX_PATH else ""


def request_frame(method: str, body: bytes, flags: int = 0) -> bytes:
    name = method.encode("ascii")
    return REQUEST.pack(len(body), len(name), flags) + name + body


def reply_frame(code: int, body: bytes) -> bytes:
    return REPLY.pack(len(body), code, 0) + body


def hello_body(metadata: Sequence[tuple[str, str]]) -> bytes:
    return json.dumps({"version": VERSION, "metadata": [list(p) for p in metadata]}).encode()


def parse_hello(body: bytes) -> Metadata:
    """The metadata of a HELLO; ValueError if it is not one of this version."""
    try:
        data = json.loads(body)
        version, pairs = data["version"], data["metadata"]
        metadata = tuple((str(k), str(v)) for k, v in pairs)
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise ValueError(f"not a hello frame: {e}") from e
    if version != VERSION:
        raise ValueError(f"express plane version {version}; this end speaks {VERSION}")
    return metadata


def error_body(details: str, trailers: Sequence[tuple[str, str | bytes]] = ()) -> bytes:
    pairs = [[k, v.decode(errors="replace") if isinstance(v, bytes) else v] for k, v in trailers]
    return json.dumps({"details": details, "trailers": pairs}).encode()


def parse_error(body: bytes) -> tuple[str, Metadata]:
    """(details, trailing metadata) of a failed call's reply."""
    try:
        data = json.loads(body)
        return str(data["details"]), tuple((str(k), str(v)) for k, v in data["trailers"])
    except (ValueError, TypeError, KeyError, RecursionError):
        return body.decode(errors="replace"), ()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """Exactly ``n`` bytes, or None if the peer closed before the first of them (a clean
    end between frames); ConnectionError if it closed within them. With ``deadline``
    (``time.monotonic()``) all of them by then, else TimeoutError: a peer sending a byte
    now and then does not stretch it. Without one, the socket's own timeout per read."""
    if n == 0:
        return b""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes by the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"the peer closed the express socket within a frame ({got}/{n})")
        got += k
    return bytes(buf)
