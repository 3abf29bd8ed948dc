"""Free TCP ports on 127.0.0.1 for the servers that tests and benchmarks start.

A port is only free when probed: another process may take it before the server
binds it, so whoever starts a server on ``free_port()`` retries with a new one
when the bind fails (``RedisServer.start`` does).
"""

from __future__ import annotations

import socket


def port_free(port: int) -> bool:
    """Whether 127.0.0.1:``port`` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_bus: bool = False) -> int:
    """A port nobody listens on now; with_bus: port + 10000 (the cluster bus) is free too."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if with_bus and (port + 10000 > 65535 or not port_free(port + 10000)):
            continue
        return port
    raise RuntimeError("no free port found")
