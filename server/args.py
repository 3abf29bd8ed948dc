"""kvstore-server's command line: its options, and the overrides they make of the file's
and the environment's configuration (``server.config.load`` applies them, last).

Every option's default is read from the config dataclasses, so ``--help`` says what a
setting is when nothing sets it.
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

from kvstore import __version__
from kvstore.config import CODECS, WRITE_POLICIES, StoreConfig
from kvstore.protocol import default_socket_path

from .config import LogFormat, LogLevel, ServerConfig


def parser() -> argparse.ArgumentParser:
    d = ServerConfig.__dataclass_fields__
    s = StoreConfig()

    def default(name: str) -> str:
        value = d[name].default
        return f" (default: {value!r})" if value not in ("", None) else ""

    p = argparse.ArgumentParser(
        prog="kvstore-server",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A tiered KV-cache store for LLM inference: L1 shared memory, L2 LMDB, "
        "L3 Redis/Valkey,\nserved over gRPC on TCP and a Unix socket.",
        epilog=(
            "Sources, later ones winning: defaults < --config FILE < KVSTORE_* environment "
            "variables < flags.\nIn the TOML file, server settings go under [server] (same "
            "names as the flags, with\nunderscores: listen, unix_socket, token_file, "
            "max_message_bytes, ...); store settings\nat the top level (data_dir, chunk_tokens, "
            "granularity, write_policy, max_chunk_bytes)\nand in [memory], [disk] and [remote]. "
            "Environment: KVSTORE_LISTEN, KVSTORE_TOKEN,\nKVSTORE_DATA_DIR, "
            "KVSTORE_MEMORY_CAPACITY_BYTES, KVSTORE_REMOTE_URL, ... Sizes accept units\n"
            "(64MiB, 1GiB). Exit status: 0 after a clean shutdown, 1 when the server cannot "
            "start\n(e.g. its data dir is in use), 2 for a bad configuration."
        ),
    )
    p.add_argument("--version", action="version", version=f"kvstore-server {__version__}")
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")

    g = p.add_argument_group("listening")
    g.add_argument(
        "--listen", metavar="HOST:PORT", help=f"TCP address; '' for none{default('listen')}"
    )
    g.add_argument(
        "--unix-socket",
        metavar="PATH",
        help=f"Unix socket path; '' for none (default: {default_socket_path()})",
    )
    g.add_argument(
        "--max-message-bytes",
        metavar="SIZE",
        help="largest gRPC message either way (default: 4MiB)",
    )
    g.add_argument(
        "--piece-bytes",
        metavar="SIZE",
        help="payload bytes per Put/Get stream message (default: 1MiB)",
    )
    g.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        metavar="N",
        help=f"worker threads for calls{default('max_concurrent_rpcs')}",
    )
    g.add_argument(
        "--max-sessions",
        type=int,
        metavar="N",
        help=f"live client Session streams{default('max_sessions')}",
    )
    g.add_argument(
        "--cpus",
        metavar="LIST",
        help="CPUs every thread of the server runs on, comma-separated, e.g. 1 or 2,3: "
        "beside a vLLM CPU engine, the cores it leaves free (default: any)",
    )
    g.add_argument(
        "--grace",
        dest="grace_s",
        type=float,
        metavar="SECONDS",
        help=f"on SIGTERM, time for in-flight calls to finish{default('grace_s')}",
    )
    g.add_argument(
        "--no-shm",
        dest="shm",
        action="store_const",
        const=False,
        help="do not offer the shared-memory data plane to same-host clients",
    )
    g.add_argument(
        "--no-express",
        dest="express",
        action="store_const",
        const=False,
        help="do not offer the express plane (unary calls over <unix-socket>.express)",
    )
    g.add_argument(
        "--idle-timeout",
        dest="idle_timeout_s",
        type=float,
        metavar="SECONDS",
        help=f"close connections with no call for this long; 0 = never{default('idle_timeout_s')}",
    )
    g.add_argument(
        "--sweep-interval",
        dest="sweep_interval_s",
        type=float,
        metavar="SECONDS",
        help=f"how often expired leases are reclaimed{default('sweep_interval_s')}",
    )

    g = p.add_argument_group("security")
    g.add_argument(
        "--token",
        help="bearer token every call must carry (health checks excepted); also KVSTORE_TOKEN",
    )
    g.add_argument("--token-file", metavar="FILE", help="read the token from FILE's first line")
    g.add_argument(
        "--tenant-tokens",
        metavar="FILE",
        help="tenants: FILE holds tenant:token lines; a tenant's token sees only the "
        "namespaces whose salt is the tenant's name (docs/security.md); "
        "--token stays the admin token",
    )
    g.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="certificate chain: serve TLS on TCP (the Unix socket stays plaintext; "
        "its file permissions guard it)",
    )
    g.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    g.add_argument(
        "--insecure",
        action="store_const",
        const=True,
        help="allow a non-loopback --listen address without a token",
    )

    g = p.add_argument_group("observability")
    g.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics, e.g. 9464 (default: 0 = off)",
    )
    g.add_argument("--metrics-host", metavar="HOST", help=f"{default('metrics_host')[1:]}")
    g.add_argument(
        "--log-level",
        choices=get_args(LogLevel),
        help=f"{default('log_level')[1:]}",
    )
    g.add_argument(
        "--log-format",
        choices=get_args(LogFormat),
        help=f"json: one object per line{default('log_format')}",
    )
    g.add_argument(
        "--log-interval",
        dest="log_interval_s",
        type=float,
        metavar="SECONDS",
        help=f"period of the request-count log line; 0 = off{default('log_interval_s')}",
    )

    g = p.add_argument_group("store")
    g.add_argument(
        "--data-dir",
        metavar="DIR",
        help=f"where L2 (LMDB) and its lock live (default: {s.data_dir})",
    )
    g.add_argument(
        "--chunk-tokens",
        type=int,
        metavar="N",
        help=f"tokens per chunk (default: {s.chunk_tokens})",
    )
    g.add_argument(
        "--granularity",
        type=int,
        metavar="N",
        help=f"partial-match unit in tokens (default: {s.granularity})",
    )
    g.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        help=f"(default: {s.write_policy})",
    )
    g.add_argument("--max-chunk-bytes", metavar="SIZE", help="largest record (default: 256MiB)")
    g.add_argument(
        "--memory-capacity",
        metavar="SIZE",
        help="size of the L1 shared-memory arena (default: 1GiB)",
    )
    g.add_argument(
        "--shm-path", metavar="PATH", help="arena file (default: a fresh file under /dev/shm)"
    )
    g.add_argument(
        "--presence-size",
        metavar="SIZE",
        help="bits of the presence filter, by which same-host clients answer lookups of "
        "prompts nothing was stored for without a call: a power of two, 0 for none "
        "(default: 8MiB; none with --remote)",
    )
    g.add_argument(
        "--lease-ms",
        type=int,
        metavar="MS",
        help=f"lease of a reservation or read (default: {s.memory.lease_ms})",
    )
    g.add_argument("--disk-capacity", metavar="SIZE", help="L2 capacity (default: 16GiB)")
    g.add_argument("--disk-path", metavar="DIR", help="LMDB directory (default: DATA_DIR/lmdb)")
    g.add_argument("--disk-codec", choices=CODECS, help=f"(default: {s.disk.codec})")
    g.add_argument(
        "--no-disk", dest="disk_enabled", action="store_const", const=False, help="no L2 tier"
    )
    g.add_argument(
        "--remote",
        metavar="URL",
        help="L3: redis://, rediss://, valkey://, valkeys://; ?cluster=1 for a "
        "cluster (default: none)",
    )
    return p


def overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    server = {name: getattr(args, name, None) for name in ServerConfig.__dataclass_fields__}
    store: dict[str, Any] = {
        "data_dir": args.data_dir,
        "chunk_tokens": args.chunk_tokens,
        "granularity": args.granularity,
        "write_policy": args.write_policy,
        "max_chunk_bytes": args.max_chunk_bytes,
        "memory": {
            "capacity_bytes": args.memory_capacity,
            "path": args.shm_path,
            "lease_ms": args.lease_ms,
            "presence_bytes": args.presence_size,
        },
        "disk": {
            "capacity_bytes": args.disk_capacity,
            "path": args.disk_path,
            "codec": args.disk_codec,
            "enabled": args.disk_enabled,
        },
        "remote": {"url": args.remote},
    }
    return server, store
