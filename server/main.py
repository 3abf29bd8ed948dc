"""kvstore-server: the daemon. Startup, signals, shutdown (its options: ``server.args``).

Startup order matters for the messages a user sees: the configuration is
validated first (exit 2), then the store is opened (a second server on the same
data dir is refused here by the disk tier's lock, exit 1), then the sockets are
bound (exit 1 if taken). Nothing of this prints a traceback.

SIGTERM or SIGINT: refuse new calls, let in-flight calls finish (``grace_s``),
end Session streams, flush pending write-downs (``store.close()``), exit 0. A
second signal while shutting down exits at once (1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from kvstore import __version__
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError, KVStoreError, StoreClosed
from kvstore.sockets import untrusted_reason

from . import logs
from .args import overrides, parser
from .config import ServerConfig, load, parse_address

log = logging.getLogger("kvstore.server")


class StartError(KVStoreError):
    """The server cannot start; the message says why."""


@dataclass
class _Running:
    server: Any
    health: Any
    socket_path: str
    socket_inode: int
    endpoints: list[str]
    express: Any = None  # server.express.ExpressPlane, when offered


def _prepare_socket(path: str) -> None:
    """Make the socket's directory (0700 if new) and refuse one that another user could
    swap the socket in (``kvstore.sockets``); refuse a live socket, remove a stale one."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(directory):
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as e:
            raise StartError(f"unix socket {path}: cannot create {directory}: {e}") from e
    why = untrusted_reason(directory)
    if why is not None:
        raise StartError(
            f"unix socket {path}: {why}. Another user could put their own socket there and "
            "receive the clients' tokens and KV: give --unix-socket a directory only this "
            "user can write to, or remove this one and let the server make it (mode 0700)"
        )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise StartError(f"unix socket {path}: {e}") from e
    if not stat.S_ISSOCK(st.st_mode):
        raise StartError(f"unix socket {path}: the path exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            try:
                os.unlink(path)  # stale: its server is gone
            except OSError as e:
                raise StartError(f"unix socket {path}: cannot remove the stale socket: {e}") from e
            return
    raise StartError(
        f"another server is listening on unix socket {path}; stop it or "
        "choose another --unix-socket"
    )


def _start(
    cfg: ServerConfig,
    service: Any,
    token: str,
    tls: tuple[bytes, bytes] | None,
    tenant_tokens: dict[str, str],
) -> _Running:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from kvstore.protocol import SERVICE_NAME

    from .auth import TokenAuth
    from .streams import add_to_server

    auth = TokenAuth(token, tenant_tokens=tenant_tokens) if token or tenant_tokens else None
    interceptors = [auth] if auth is not None else []
    pool = futures.ThreadPoolExecutor(
        max_workers=cfg.max_concurrent_rpcs + cfg.max_sessions, thread_name_prefix="kvstore-rpc"
    )
    options = [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", 0),  # else a second server could bind the same port silently
        # Idle links: clients ping every 30 s, with calls or without (kvstore.sdk.base's
        # CHANNEL_OPTIONS); pings are accepted up to once a second, so no client's keepalive
        # gets its connection closed for pinging too often (GOAWAY "too_many_pings" past the
        # default floor of 5 minutes). The server pings too, so a client gone silent (a dead
        # host, a dropped NAT entry) is let go of in 80 s.
        ("grpc.keepalive_permit_without_calls", 1),
        # gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS is this string;
        # "grpc.http2.min_recv_ping_interval_without_data_ms" has no effect (measured with
        # grpcio 1.85: pings every 1.5 s were refused with it set to 1 s).
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.ping_timeout_ms", 20_000),  # what bounds a ping's wait (kvstore.sdk.base)
    ]
    if cfg.idle_timeout_s:
        # A connection with no call for this long is closed with a GOAWAY; its client
        # dials again at its next call, which does not fail for it.
        options.append(("grpc.max_connection_idle_ms", int(cfg.idle_timeout_s * 1000)))
    server = grpc.server(pool, interceptors=interceptors, options=options)
    add_to_server(service, server)
    health_servicer = health.HealthServicer(
        experimental_non_blocking=True,
        experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=2),
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )

    endpoints = []
    if cfg.listen:
        host, port = parse_address(cfg.listen)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is not None:
                bound = server.add_secure_port(target, grpc.ssl_server_credentials([tls]))
            else:
                bound = server.add_insecure_port(target)
        except RuntimeError as e:
            raise StartError(f"cannot listen on {cfg.listen}: {e} (is the port in use?)") from e
        if not bound:
            raise StartError(f"cannot listen on {cfg.listen} (is the port in use?)")
        shown = f"{host}:{bound}" if ":" not in host else f"[{host}]:{bound}"
        endpoints.append(f"{'grpcs' if tls else 'grpc'}://{shown}")
    inode = 0
    if cfg.unix_socket:
        _prepare_socket(cfg.unix_socket)
        try:
            server.add_insecure_port(f"unix:{os.path.abspath(cfg.unix_socket)}")
        except RuntimeError as e:
            raise StartError(f"cannot listen on unix socket {cfg.unix_socket}: {e}") from e
        endpoints.append(f"unix://{os.path.abspath(cfg.unix_socket)}")
    plane = _start_express(cfg, service, auth)
    try:
        server.start()
    except BaseException:
        if plane is not None:
            plane.stop()
        raise
    if cfg.unix_socket:
        inode = os.stat(cfg.unix_socket).st_ino
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return _Running(server, health_servicer, cfg.unix_socket, inode, endpoints, plane)


def _start_express(cfg: ServerConfig, service: Any, auth: Any) -> Any:
    """The express plane beside the Unix socket (None where it is not offered)."""
    from kvstore import express

    from .express import ExpressPlane

    if not (cfg.express and cfg.unix_socket):
        return None
    path = express.socket_path(os.path.abspath(cfg.unix_socket))
    if not path:
        log.warning(
            "express plane not offered: %s%s would be too long for a Unix socket's path",
            cfg.unix_socket,
            express.SUFFIX,
        )
        return None
    _prepare_socket(path)
    try:
        plane = ExpressPlane(
            service,
            path,
            refusal=auth.refusal if auth is not None else (lambda metadata: None),
            max_frame=cfg.max_message_bytes,
            max_connections=cfg.express_connections,
            max_calls=cfg.max_concurrent_rpcs,
        )
    except OSError as e:
        raise StartError(f"cannot listen on unix socket {path}: {e}") from e
    service.offer_express(path)
    return plane


def _housekeeping(service: Any, store: Any, cfg: ServerConfig, stop: threading.Event) -> None:
    """The servicer's sweep and the store's upkeep (expired leases reclaimed, refused remote
    copies retried) every sweep_interval_s; request counts logged every log_interval_s."""
    last_log, last_counts = time.monotonic(), service.request_counts()
    # Same-host clients trust the presence filter's "nothing stored" only while the server
    # vouches for it: renewed at each sweep, for long enough that a late sweep or two
    # does not void it, short enough that a server killed stops being believed soon.
    live_for = 3 * cfg.sweep_interval_s + 1.0
    store.vouch_presence(live_for)
    while not stop.wait(cfg.sweep_interval_s):
        try:
            service.sweep()
            store.upkeep()
            store.vouch_presence(live_for)
        except StoreClosed:
            return
        except Exception:  # the sweeper must outlive any one failure
            log.exception("lease sweep failed")
        if cfg.log_interval_s and time.monotonic() - last_log >= cfg.log_interval_s:
            counts = service.request_counts()
            delta = {
                k: v - last_counts.get(k, 0)
                for k, v in counts.items()
                if v != last_counts.get(k, 0)
            }
            if delta:  # an idle server stays quiet
                log.info(
                    "requests in the last %.0f s: %d",
                    time.monotonic() - last_log,
                    sum(delta.values()),
                    extra={"requests": delta},
                )
            last_log, last_counts = time.monotonic(), counts


def _bind(cpus: tuple[int, ...]) -> None:
    """Put every thread of the server on ``cpus``: those running now (an import or the
    logging may have started some), and, as each thread inherits the CPUs of the one
    that starts it, every later one (gRPC's own included)."""
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), cpus)
    except OSError as e:
        raise ConfigError(
            f"cpus={','.join(map(str, cpus))}: not CPUs this process may run on "
            f"({','.join(map(str, sorted(allowed)))})"
        ) from e
    log.info("running on CPUs %s", ",".join(map(str, sorted(os.sched_getaffinity(0)))))


def serve(cfg: ServerConfig, store_cfg: StoreConfig) -> int:
    if cfg.cpus:
        _bind(cfg.cpus)
    token = cfg.read_token()
    tenant_tokens = cfg.read_tenants(token)
    tls = cfg.read_tls()
    from kvstore.engine.store import TieredStore

    from .heap import keep_full_collections_short
    from .metrics import Metrics
    from .service import KVStoreService
    from .tenants import Tenants

    store = TieredStore(store_cfg)  # a second server on this data dir fails here
    stop, housekeeping_stop = threading.Event(), threading.Event()
    signals = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            log.error("second signal: exiting without waiting")
            os._exit(1)
        log.info("%s received: shutting down", signal.Signals(signum).name)
        stop.set()

    metrics = Metrics(store)
    try:
        service = KVStoreService(
            store,
            cfg,
            metrics=metrics,
            auth_required=bool(token or tenant_tokens),
            tenants=Tenants(tenant_tokens, max_per_tenant=cfg.max_namespaces_per_tenant),
        )
        metrics.watch(service.table_figures)
        if cfg.metrics_port:
            metrics.start(cfg.metrics_host, cfg.metrics_port)
        running = _start(cfg, service, token, tls, tenant_tokens)
    except BaseException:
        metrics.stop()
        store.close()
        raise
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # What is alive now (the index, the listeners) lives as long as the server: frozen,
    # so that full collections walk only what came since (server/heap.py).
    keep_full_collections_short(cfg.gc_pause_ms)
    keeper = threading.Thread(
        target=_housekeeping,
        args=(service, store, cfg, housekeeping_stop),
        name="kvstore-housekeeping",
        daemon=True,
    )
    keeper.start()
    log.info(
        "kvstore-server %s listening on %s; tiers %s; data dir %s; shared memory %s",
        __version__,
        ", ".join(running.endpoints),
        store.tier_names,
        store_cfg.data_dir,
        store.arena.path if cfg.shm else "off",
        extra={"endpoints": running.endpoints, "pid": os.getpid()},
    )
    while not stop.wait(1.0):
        pass

    t0 = time.monotonic()
    running.health.enter_graceful_shutdown()
    drained = service.shutdown(cfg.grace_s)
    if not drained:
        log.warning("in-flight calls did not finish within %.1f s; cancelling them", cfg.grace_s)
    if running.express is not None:
        running.express.stop()  # its calls in flight finish before the store closes
    running.server.stop(0).wait(5.0)  # ends Session streams (their leases are dropped)
    housekeeping_stop.set()
    keeper.join(timeout=5.0)
    metrics.stop()
    pending = store.stats().pending_writes
    store.close()  # flushes pending write-downs
    if running.socket_path:
        try:
            if os.stat(running.socket_path).st_ino == running.socket_inode:
                os.unlink(running.socket_path)
        except OSError:
            pass
    log.info(
        "stopped in %.2f s (%d write-downs flushed)",
        time.monotonic() - t0,
        pending,
        extra={"requests": service.request_counts()},
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    server_over, store_over = overrides(args)
    try:
        cfg, store_cfg = load(args.config, server=server_over, store=store_over)
    except ConfigError as e:
        print(f"kvstore-server: error: {e}", file=sys.stderr)
        return 2
    logs.setup(cfg.log_level, cfg.log_format)
    try:
        return serve(cfg, store_cfg)
    except ConfigError as e:
        log.error("cannot start: %s", e)
        return 2
    except KVStoreError as e:
        log.error("cannot start: %s", e)
        return 1
    except KeyboardInterrupt:
        log.error("interrupted during startup")
        return 1


if __name__ == "__main__":
    sys.exit(main())
