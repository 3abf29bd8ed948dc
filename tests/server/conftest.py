"""Fixtures with real kvstore-server processes for the server and SDK tests.

``server`` is one shared instance for the tests that only need a running server;
tests that need their own flags (auth, TLS, restarts) call ``make_server``. Every
process is stopped by the fixtures. ``KVServer`` itself lives in
``kvstore.testing.server``.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.testing.server import KVServer

__all__ = ["make_server", "server"]


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
