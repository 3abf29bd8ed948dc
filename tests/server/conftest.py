"""Real kvstore-server processes for the server and SDK tests.

``KVServer`` runs ``python -m kvstore.server.main`` on a free TCP port and a Unix
socket in a temp dir, with its data dir there and a 64 MiB arena. ``server`` is
one shared instance for the tests that only need a running server; tests that
need their own flags (auth, TLS, restarts) call ``make_server``. Every process
is stopped by the fixtures (and killed at exit if a test run is interrupted).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.servers import free_port

START_TIMEOUT_S = 30.0
_live: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_all() -> None:
    for proc in list(_live):
        with contextlib.suppress(OSError):
            proc.kill()


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test environment without KVSTORE_* settings that would leak into a server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(extra or {})
    return env


class KVServer:
    def __init__(
        self,
        root: Path,
        name: str = "kv",
        *,
        args: Sequence[str] = (),
        data_dir: Path | None = None,
        env: dict[str, str] | None = None,
        memory: str = "64MiB",
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.name = name
        self.port = free_port()
        self.socket = root / f"{name}.sock"
        self.data_dir = data_dir or root / f"{name}-data"
        self.log_path = root / f"{name}.log"
        self.args = list(args)
        self.env = clean_env(env)
        self.memory = memory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def tcp_url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvstore.server.main",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--unix-socket",
            str(self.socket),
            "--data-dir",
            str(self.data_dir),
            "--memory-capacity",
            self.memory,
            "--sweep-interval",
            "0.2",
            "--grace",
            "5",
            *self.args,
        ]

    def start(self, *, wait: bool = True) -> KVServer:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child process
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        log.close()
        _live.add(self.proc)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until the server answers a health check on its Unix socket."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"kvstore-server exited with {self.proc.returncode} "
                        f"during startup:\n{self.log()}"
                    )
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise AssertionError(f"kvstore-server not ready after {timeout} s:\n{self.log()}")

    def wait(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"kvstore-server did not exit in {timeout} s:\n{self.log()}"
            ) from None
        _live.discard(self.proc)
        return rc

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the server and wait for it; its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        return self.wait(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVServer]:
    """One server shared by the tests that just need a running one."""
    srv = KVServer(tmp_path_factory.mktemp("server"), "shared").start()
    yield srv
    rc = srv.stop()
    assert rc == 0, f"shared server exited with {rc}:\n{srv.log()}"


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., KVServer]]:
    """Build (not start) servers in tmp_path; all are stopped after the test."""
    made: list[KVServer] = []

    def factory(name: str = "kv", **kw: object) -> KVServer:
        srv = KVServer(tmp_path, name, **kw)  # type: ignore[arg-type]
        made.append(srv)
        return srv

    yield factory
    for srv in made:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
