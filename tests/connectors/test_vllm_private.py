"""The embedded default's private servers, without an engine: real kvstore-server processes
started the way the connector starts them, cache slots under a temporary XDG_CACHE_HOME.

What must hold: a restart finds the cache it left (its own slot, even when a lower one
is free); two engines running at once never share one data dir; an engine's other
processes join its server; the CLI reaches it at a fixed socket; leftovers of engines
that are gone are removed and live ones never are; persist=false and data_dir work.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvstore.connectors import vllm_private
from kvstore.connectors.vllm_config import ConnectorConfig
from kvstore.connectors.vllm_private import PrivateServer, open_private, sweep_engine_dirs

from kvstore import Client
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import ROOT, Namespace
from kvstore.testing.procs import thread_cpus
from kvstore.testing.server import KVServer

CFG = ConnectorConfig(memory_capacity="64MiB", disk_capacity="64MiB")
NS = Namespace(model="tiny", dtype="float32", layout="block16")
TOKENS = list(range(256))


@pytest.fixture
def dirs(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """(run dir, cache root) under a short temporary HOME: socket paths must stay < 108 bytes."""
    root = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
    monkeypatch.setenv("HOME", str(root / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("TMPDIR", str(root / "tmp"))
    (root / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() caches its answer
    yield Path(vllm_private.run_root()), Path(vllm_private.cache_root())
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def started() -> Iterator[list[PrivateServer]]:
    """Servers a test opened; stopped after it whatever happened."""
    servers: list[PrivateServer] = []
    yield servers
    for s in servers:
        s.stop()


def open_engine(
    started: list[PrivateServer], engine_id: str, tag: str, cfg: ConnectorConfig = CFG
) -> str:
    url, server = open_private(cfg, engine_id, tag, f"model {tag}")
    if server is not None:
        started.append(server)
    return url


def disk_path(url: str) -> str:
    with Client(url, shm=False) as c:
        disk = next(t for t in c.stats().tiers if t.name == "disk")
    return str(disk.detail["path"])


def test_slots_for_concurrent_engines_and_a_restart_finds_its_own(
    dirs: tuple[Path, Path], started: list[PrivateServer]
) -> None:
    run, cache = dirs
    assert str(cache) == os.path.join(os.environ["HOME"], ".cache", "kvstore", "vllm")
    url_a = open_engine(started, "aaaa-1", "tagA")
    url_b = open_engine(started, "bbbb-1", "tagB")
    assert url_a == f"unix://{run}/vllm-0.sock", url_a
    assert url_b == f"unix://{run}/vllm-1.sock", "a second engine at once must get slot 1"
    assert disk_path(url_a) == str(cache / "slot-0" / "lmdb")
    assert disk_path(url_b) == str(cache / "slot-1" / "lmdb")
    # Another process of engine A (its worker) joins A's server; it starts nothing.
    url, joined = open_private(CFG, "aaaa-1", "tagA", "model tagA")
    assert (url, joined) == (url_a, None), "an engine's second process must join its server"

    with Client(url_a, shm=False) as c:
        key, status = c.put_chunk(NS, ROOT, TOKENS, np.full(4096, 7, np.uint8), "uint8", (4096,))
        assert status.name == "STORED", status
    # The CLI reaches a running engine's store at the fixed socket.
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "--url", url_a, "--json", "stats"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    tiers = {t["name"]: t for t in json.loads(out.stdout)["tiers"]}
    assert tiers["disk"]["detail"]["path"] == str(cache / "slot-0" / "lmdb"), tiers["disk"]

    for s in started:
        s.stop()
    started.clear()
    assert not list(run.glob("engine-*")), "a stopped engine must remove its directory"
    assert (cache / "slot-1" / "engine").read_text().startswith("tagB\n")

    # Restarts in the other order: B takes its own slot 1 though slot 0 is free, and A
    # finds the chunk it stored before.
    assert open_engine(started, "bbbb-2", "tagB") == url_b, "B must get the slot it used"
    assert open_engine(started, "aaaa-2", "tagA") == url_a, "A must get the slot it used"
    with Client(url_a, shm=False) as c:
        got = c.get(key)
    assert got is not None, "the chunk stored before the restart must still be there"
    assert bytes(got[1]) == bytes(np.full(4096, 7, np.uint8))


def test_a_slot_whose_lmdb_another_server_holds_is_skipped(
    dirs: tuple[Path, Path], started: list[PrivateServer]
) -> None:
    """The probe reads the disk tier's own lock: a server on slot-0 with another socket
    (the CLI user's, say) keeps every engine off that LMDB."""
    run, cache = dirs
    other = KVServer(run.parent / "other", "kv", data_dir=cache / "slot-0", memory="16MiB")
    other.start()
    try:
        url = open_engine(started, "cccc-1", "tagC")
        assert url == f"unix://{run}/vllm-1.sock", "slot 0's LMDB is held: slot 1 it must be"
    finally:
        assert other.stop() == 0, other.log()
    assert open_engine(started, "dddd-1", "tagD") == f"unix://{run}/vllm-0.sock"


def test_persist_false_is_temporary_and_data_dir_is_kept(
    dirs: tuple[Path, Path], started: list[PrivateServer], tmp_path: Path
) -> None:
    run, cache = dirs
    url = open_engine(
        started, "eeee-1", "tagE", ConnectorConfig(memory_capacity="64MiB", persist=False)
    )
    engine_dir = run / "engine-eeee-1"
    assert disk_path(url) == str(engine_dir / "data" / "lmdb")
    started.pop().stop()
    assert not engine_dir.exists(), "persist=false: the cache must go with the engine"
    assert not cache.exists(), "persist=false must not create the persistent cache"

    data = tmp_path / "mine"
    url = open_engine(
        started, "ffff-1", "tagF", ConnectorConfig(memory_capacity="64MiB", data_dir=str(data))
    )
    assert disk_path(url) == str(data / "lmdb")
    started.pop().stop()
    assert (data / "lmdb" / "data.mdb").exists(), "a data_dir given must stay"


def test_a_server_started_by_a_bound_worker_runs_on_the_cpus_it_is_given(
    dirs: tuple[Path, Path], started: list[PrivateServer]
) -> None:
    """A CPU worker is bound to its compute cores and a server it starts would inherit
    them: with ``cpus`` (the worker's spare cores) every thread of the server runs there."""
    one = max(os.sched_getaffinity(0))
    url, server = open_private(CFG, "cpus-1", "tagC", "model tagC", cpus=frozenset({one}))
    assert server is not None, "nothing ran: this test must start the server"
    started.append(server)
    with Client(url) as c:  # calls start the server's threads that start on demand
        key, status = c.put_chunk(NS, ROOT, TOKENS, np.zeros(1024, np.float32), "float32", (1024,))
        assert status.ok and c.get(key) is not None
    stray = {t: c for t, c in thread_cpus(server.proc.pid).items() if c != {one}}
    assert not stray, f"threads of the private server not on CPU {one}: {stray}"


def test_config_persist() -> None:
    assert ConnectorConfig.parse({"persist": "false"}).persist is False
    assert ConnectorConfig.parse({}).persist is True
    with pytest.raises(ConfigError, match="persist=false and data_dir"):
        ConnectorConfig.parse({"persist": False, "data_dir": "/var/lib/x"})


def test_leftovers_of_gone_engines_are_removed_live_ones_kept(
    dirs: tuple[Path, Path], started: list[PrivateServer]
) -> None:
    run, _ = dirs
    run.mkdir(parents=True, exist_ok=True)
    # The layout before slots: engine-ID/{kvstore.sock, data/lmdb}. One killed with -9
    # (stale socket, LMDB left behind), one still running.
    dead = KVServer(run / "engine-dead", "kvstore", data_dir=run / "engine-dead" / "data")
    dead.start()
    dead.stop(signal.SIGKILL)
    live = KVServer(run / "engine-live", "kvstore", data_dir=run / "engine-live" / "data")
    live.start()
    try:
        assert (run / "engine-dead" / "kvstore.sock").exists(), "a killed server's socket stays"
        # This layout: a URL file pointing at a socket nobody serves any more.
        (run / "engine-gone").mkdir()
        (run / "engine-gone" / "server").write_text(f"unix://{run}/vllm-9.sock\n")
        # An engine starting right now holds its start.lock.
        (run / "engine-busy").mkdir()
        with open(run / "engine-busy" / "start.lock", "a") as busy:
            fcntl.flock(busy, fcntl.LOCK_EX)
            open_engine(started, "gggg-1", "tagG")  # sweeps before it starts
            left = sorted(p.name for p in run.glob("engine-*"))
        assert left == ["engine-busy", "engine-gggg-1", "engine-live"], left
        assert sweep_engine_dirs(str(run)) == [str(run / "engine-busy")], (
            "once its start.lock is free and no server answers, it goes too"
        )
        with Client(live.unix_url, shm=False) as c:
            assert c.health(), "a live engine's server must be left alone"
    finally:
        assert live.stop() == 0, live.log()


def test_a_run_dir_others_can_change_is_refused(
    dirs: tuple[Path, Path], started: list[PrivateServer]
) -> None:
    """Another user able to write there could plant a ``server`` file naming their socket."""
    run, _ = dirs
    (run / "engine-planted").mkdir(parents=True)
    (run / "engine-planted" / "server").write_text("unix:///tmp/not-yours.sock\n")
    run.chmod(0o770)
    with pytest.raises(KVStoreError, match="writable by its group"):
        open_engine(started, "planted", "tagP")
    assert (run / "engine-planted").exists(), "nothing may be read or removed there"
    assert not started
