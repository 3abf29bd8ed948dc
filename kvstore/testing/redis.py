"""Real redis-server / valkey-server processes, on free ports in temp dirs.

For the tests (L3 tier, store, fault suite) and the benchmarks (``remote``, the
soak). Plain classes, not pytest fixtures, so any test module or benchmark can
wrap them in fixtures of the scope it needs. Every process started here is also
registered with ``atexit``, so a test that forgets to stop one (or a crashed
session) does not leave servers behind. Needs the ``redis-server`` /
``valkey-server`` binaries (``available(flavor)`` says whether they are there).

    server = RedisServer("valkey")          # started on a free port
    server.url                              # "valkey://127.0.0.1:<port>"
    server.stop(); server.start()           # same port again: "the remote comes back"
    server.kill()                           # SIGKILL, like a crash
    server.close()                          # stop and remove its temp dir

    cluster = ServerCluster(3)              # 3 primaries, no replicas, cluster_state:ok
    cluster.url                             # "valkey://127.0.0.1:<port>?cluster=1"
    cluster.nodes[1].stop()                 # one node goes away

    group = SentinelGroup("redis")          # a primary, its replica, a sentinel watching
    group.url                               # "redis+sentinel://127.0.0.1:<port>/kvstore"
    group.failover()                        # SENTINEL FAILOVER; or group.primary.kill()
    group.wait_primary(group.replica.port)  # until the sentinels name the new primary
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from kvstore.testing.ports import free_port
from kvstore.testing.procs import freeze, thaw

__all__ = [
    "FLAVORS",
    "RedisServer",
    "SentinelGroup",
    "SentinelServer",
    "ServerCluster",
    "available",
    "free_port",
]

FLAVORS = ("redis", "valkey")
START_TIMEOUT_S = 10.0

_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()
_strong: set[RedisServer] = set()  # keeps running servers alive until stopped


def _ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server or valkey-server process bound to 127.0.0.1 on a free port."""

    def __init__(
        self,
        flavor: str = "redis",
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        cluster: bool = False,
        start: bool = True,
    ) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
        self.flavor = flavor
        self.cluster = cluster
        self.binary = shutil.which(f"{flavor}-server") or f"{flavor}-server"
        self.cli_binary = shutil.which(f"{flavor}-cli") or f"{flavor}-cli"
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port(with_bus=cluster)
        self.args = list(args)
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvstore-{flavor}-"))
        self.log = self.dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        _live.add(self)
        # The temp dir goes even if the object is dropped without close().
        self._rm_dir = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        if start:
            self.start()

    # -- addresses ------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"{self.flavor}://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle ------------------------------------------------------------
    def _command(self) -> list[str]:
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.log),
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
        ]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        return cmd + self.args

    def start(self) -> RedisServer:
        """Start (again) and wait until it answers PING. Same port as before."""
        if self.running:
            return self
        # Another process may grab a "free" port between our probe and the bind:
        # pick a new one, unless the port was given or we are restarting.
        attempts = 1 if self._fixed_port or self.proc is not None else 5
        for attempt in range(attempts):
            self.proc = subprocess.Popen(
                self._command(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            _strong.add(self)
            if self._wait_ready():
                return self
            self._reap()
            if attempt + 1 < attempts and "in use" in self.log_tail():
                self.port = free_port(with_bus=self.cluster)
                continue
            break
        raise RuntimeError(f"{self.binary} on port {self.port} did not start:\n{self.log_tail()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if _ping(self.port):
                return True
            time.sleep(0.02)
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful shutdown (SIGTERM; nothing is saved). The port can be reused by start()."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)  # a paused server cannot shut down
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._reap()

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing anything, like a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._reap()

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections (kernel backlog) but never answers."""
        if self.proc is not None:
            freeze(self.proc)

    def resume(self) -> None:
        if self.proc is not None:
            thaw(self.proc)

    def _reap(self) -> None:
        _strong.discard(self)

    def close(self) -> None:
        """Stop the server and remove its temp dir."""
        self.stop()
        self._rm_dir()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------
    def cli(self, *args: str, check: bool = True) -> str:
        """Run ``<flavor>-cli -p <port> args...`` and return its stdout."""
        done = subprocess.run(
            [self.cli_binary, "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.cli_binary} {' '.join(args)} failed: {done.stderr}")
        return done.stdout

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer({self.flavor!r}, port={self.port}, {state})"


class ServerCluster:
    """N cluster-enabled primaries (no replicas), created with ``--cluster create``.

    Nodes are started with ``cluster-require-full-coverage no`` so that, with one
    node down, the others keep serving the slots they own.
    """

    def __init__(
        self,
        n: int = 3,
        flavor: str = "valkey",
        *,
        node_timeout_ms: int = 2000,
        args: Sequence[str] = (),
    ) -> None:
        if n < 3:
            raise ValueError("a cluster needs at least 3 primaries")
        self.flavor = flavor
        self.nodes: list[RedisServer] = []
        extra = [
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--cluster-require-full-coverage",
            "no",
            *args,
        ]
        try:
            for _ in range(n):
                self.nodes.append(RedisServer(flavor, args=extra, cluster=True))
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        first = self.nodes[0]
        done = subprocess.run(
            [
                first.cli_binary,
                "--cluster",
                "create",
                *(s.address for s in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"cluster create failed:\n{done.stdout}\n{done.stderr}")
        self.wait_ok()

    def wait_ok(self, timeout: float = 15.0) -> None:
        """Wait until every running node reports cluster_state:ok and knows all nodes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [s.cli("cluster", "info", check=False) for s in self.nodes if s.running]
            if all("cluster_state:ok" in i and "cluster_slots_assigned:16384" in i for i in infos):
                return
            time.sleep(0.05)
        raise RuntimeError("cluster did not reach cluster_state:ok in time")

    @property
    def url(self) -> str:
        return f"{self.nodes[0].url}?cluster=1"

    def stop_node(self, i: int) -> RedisServer:
        """Stop node ``i`` (graceful); ``start_node(i)`` brings it back on the same port."""
        self.nodes[i].stop()
        return self.nodes[i]

    def start_node(self, i: int) -> RedisServer:
        return self.nodes[i].start()

    def urls(self) -> list[str]:
        return [s.url for s in self.nodes]

    def node_of(self, key: bytes) -> RedisServer:
        """The node that owns the slot of ``key`` (asks a running node)."""
        alive = next(s for s in self.nodes if s.running)
        # redis-cli would mangle binary keys; hex-named keys are plain ASCII anyway.
        slot = int(alive.cli("cluster", "keyslot", key.decode()).strip())
        for line in alive.cli("cluster", "nodes").splitlines():
            fields = line.split()
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            for rng in fields[8:]:
                if rng.startswith("["):
                    continue
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    return next(s for s in self.nodes if s.port == port)
        raise RuntimeError(f"no node owns slot {slot}")

    def close(self) -> None:
        for s in self.nodes:
            s.close()

    def __enter__(self) -> ServerCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SentinelServer(RedisServer):
    """A sentinel (``<flavor>-server <conf> --sentinel``) watching one primary."""

    def __init__(
        self,
        flavor: str,
        primary_port: int,
        *,
        service: str = "kvstore",
        quorum: int = 1,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:
        self.service = service
        self._monitor = (primary_port, quorum, down_after_ms, failover_timeout_ms)
        super().__init__(flavor)

    def _command(self) -> list[str]:
        # A sentinel rewrites its config file with what it learns: written once, so a
        # restarted sentinel remembers the failovers it saw, as a real one would.
        conf = self.dir / "sentinel.conf"
        if not conf.exists():
            port, quorum, down_ms, failover_ms = self._monitor
            name = self.service
            conf.write_text(
                f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\n"
                f"dir {self.dir}\nlogfile {self.log}\n"
                f"sentinel monitor {name} 127.0.0.1 {port} {quorum}\n"
                f"sentinel down-after-milliseconds {name} {down_ms}\n"
                f"sentinel failover-timeout {name} {failover_ms}\n"
                f"sentinel parallel-syncs {name} 1\n"
            )
        return [self.binary, str(conf), "--sentinel", *self.args]

    def primary(self) -> tuple[str, int] | None:
        """The primary this sentinel names for its service now."""
        out = self.cli("sentinel", "get-master-addr-by-name", self.service, check=False).split()
        return (out[0], int(out[1])) if len(out) == 2 and out[1].isdigit() else None


class SentinelGroup:
    """A primary, one replica of it and ``sentinels`` sentinels (quorum: a majority),
    ready for a failover: the replica is in sync and known to every sentinel."""

    def __init__(
        self, flavor: str = "redis", *, sentinels: int = 1, service: str = "kvstore"
    ) -> None:
        self.flavor, self.service = flavor, service
        self.primary = RedisServer(flavor)
        self.replica: RedisServer | None = None
        self.sentinels: list[SentinelServer] = []
        try:
            self.replica = RedisServer(
                flavor, args=["--replicaof", "127.0.0.1", str(self.primary.port)]
            )
            for _ in range(sentinels):
                self.sentinels.append(
                    SentinelServer(
                        flavor, self.primary.port, service=service, quorum=sentinels // 2 + 1
                    )
                )
            self.wait_ready()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        hosts = ",".join(s.address for s in self.sentinels)
        return f"{self.flavor}+sentinel://{hosts}/{self.service}"

    @property
    def servers(self) -> list[RedisServer]:
        return [self.primary] + ([self.replica] if self.replica is not None else [])

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Until the replica's link is up and every sentinel lists it."""
        assert self.replica is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            linked = "master_link_status:up" in self.replica.cli("info", "replication", check=False)
            known = all(
                "127.0.0.1" in s.cli("sentinel", "replicas", self.service, check=False)
                for s in self.sentinels
            )
            if linked and known:
                return
            time.sleep(0.1)
        raise RuntimeError("the replica or the sentinels did not come up in time")

    def sync(self) -> None:
        """Wait until the replica has every write made so far (WAIT 1)."""
        self.current().cli("wait", "1", "5000")

    def named_primary(self) -> tuple[str, int] | None:
        for s in self.sentinels:
            if s.running:
                found = s.primary()
                if found is not None:
                    return found
        return None

    def current(self) -> RedisServer:
        """The server the sentinels name as primary."""
        found = self.named_primary()
        return next(s for s in self.servers if found is not None and s.port == found[1])

    def failover(self) -> None:
        """SENTINEL FAILOVER: the replica is promoted, the primary demoted, no data lost."""
        self.sentinels[0].cli("sentinel", "failover", self.service)

    def wait_primary(self, port: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.named_primary()
            if found is not None and found[1] == port:
                return
            time.sleep(0.05)
        raise RuntimeError(f"the sentinels did not name port {port} the primary in time")

    def close(self) -> None:
        for s in [*self.sentinels, *self.servers]:
            s.close()

    def __enter__(self) -> SentinelGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.close()


def available(flavor: str) -> bool:
    """Whether ``<flavor>-server`` and ``<flavor>-cli`` are installed (tests skip otherwise)."""
    return all(shutil.which(f"{flavor}-{tool}") for tool in ("server", "cli"))
