"""Real kvstore-server processes for tests and benchmarks.

``KVServer`` runs ``python -m kvstore.server.main`` (this interpreter) on a free
TCP port and a Unix socket under a root directory of the caller's, with its data
dir and log there and a 64 MiB arena by default; ``args`` adds flags (auth, TLS,
tiers). ``start()`` waits until the health check answers; ``stop()`` signals it
and returns its exit status. Every process started here is killed at exit if
its owner did not stop it (an interrupted test run, a crashed soak). The pytest
fixtures around it live in ``tests/server/conftest.py``.

    srv = KVServer(tmp_path, "kv", args=["--no-disk"]).start()
    kvstore.Client(srv.unix_url)         # same host: shared memory
    srv.stop()                           # SIGTERM; 0 on a clean shutdown
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.testing.ports import free_port
from kvstore.testing.procs import freeze, thaw

__all__ = ["KVServer", "clean_env"]

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
    """One kvstore-server process of the caller's, built stopped; ``start()`` runs it.

    Failures to start or stop raise ``AssertionError`` with the server's log: in a
    test they read as the test's failure, which is what they are.
    """

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
        """The command line: expired leases reclaimed every 0.2 s, 5 s to drain on SIGTERM."""
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
        """Until the process exits (killed after ``timeout``); its exit code."""
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

    def pause(self) -> None:
        """SIGSTOP, returning once it is stopped: it accepts connections, answers none."""
        assert self.proc is not None
        freeze(self.proc)

    def resume(self) -> None:
        """SIGCONT (wait_ready to know it answers again)."""
        assert self.proc is not None
        thaw(self.proc)

    def log(self) -> str:
        """The last 6000 characters of the server's log (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return "(no log)"
