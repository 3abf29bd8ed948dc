"""Where a client dials: the server's URL read once, and the checks made before dialing.

``grpc://host[:port]``, ``grpcs://host[:port]`` (TLS, with ``read_tls_ca``'s roots),
``unix:///path`` or a bare ``host:port``; no URL at all means ``$KVSTORE_URL``, else the
default socket, which a client refuses to dial in a directory it cannot trust.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.protocol import DEFAULT_PORT, default_socket_path
from kvstore.sockets import untrusted_reason


@dataclass(frozen=True)
class Endpoint:
    url: str
    target: str  # what grpc dials
    tls: bool


def parse_url(url: str | None = None) -> Endpoint:
    """grpc://host[:port], grpcs://host[:port], unix:///path, or a bare host:port."""
    url = url or os.environ.get("KVSTORE_URL") or f"unix://{default_socket_path()}"
    if url.startswith("unix://") or url.startswith("unix:"):
        path = url[len("unix://") :] if url.startswith("unix://") else url[len("unix:") :]
        if not path:
            raise InvalidArgument(f"{url!r}: a unix URL needs a path, e.g. unix:///tmp/kv.sock")
        return Endpoint(url, f"unix:{path}", False)
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "grpc", url
    if scheme not in ("grpc", "grpcs") or not rest or "/" in rest.rstrip("/"):
        raise InvalidArgument(
            f"{url!r}: expected grpc://host:port, grpcs://host:port or unix:///path"
        )
    rest = rest.rstrip("/")
    if not rest.rsplit("]", 1)[-1].count(":"):
        rest = f"{rest}:{DEFAULT_PORT}"
    return Endpoint(url, rest, scheme == "grpcs")


def check_default_socket(ep: Endpoint) -> None:
    """Refuse to dial the default socket in a directory this user cannot trust.

    ``$TMPDIR/kvstore-$UID`` is a predictable name: whoever made it first, or can
    write to it, can listen there and receive this client's token and KV. An explicit
    socket path is the operator's choice (the server checks its own side of it).
    """
    if not ep.target.startswith("unix:"):
        return
    path = os.path.abspath(ep.target[len("unix:") :])
    if path != os.path.abspath(default_socket_path()):
        return
    directory = os.path.dirname(path)
    if not os.path.lexists(directory):
        return  # no server has started yet: the connection fails, and nothing is sent
    why = untrusted_reason(directory)
    if why is not None:
        raise ConfigError(
            f"{ep.url}: not dialing the default socket: {why}. Another user could be "
            "listening there for this client's token; remove the directory if it is not "
            "yours (the server makes it, mode 0700), or give the server's URL explicitly"
        )


def read_tls_ca(tls_ca: str | bytes | None) -> bytes | None:
    if tls_ca is None or isinstance(tls_ca, bytes):
        return tls_ca
    try:
        with open(os.path.expanduser(tls_ca), "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(f"tls_ca={tls_ca!r}: cannot read it: {e}") from e
