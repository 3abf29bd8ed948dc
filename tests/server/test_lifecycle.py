"""Starting, refusing to start, and stopping kvstore-server without losing data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import kvstore
from kvstore.errors import KVStoreError
from kvstore.keys import ROOT, ChunkKey
from kvstore.testing.procs import thread_cpus
from kvstore.testing.redis import RedisServer, available, free_port
from kvstore.testing.server import KVServer, clean_env
from tests.server.helpers import namespace, payload, tokens


def test_help_documents_every_option() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.server.main", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr
    for option in (
        "--listen",
        "--unix-socket",
        "--token",
        "--token-file",
        "--tls-cert",
        "--tls-key",
        "--insecure",
        "--metrics-port",
        "--max-message-bytes",
        "--piece-bytes",
        "--max-concurrent-rpcs",
        "--log-format",
        "--config",
        "--cpus",
        "--data-dir",
        "--memory-capacity",
        "--remote",
        "KVSTORE_",
    ):
        assert option in done.stdout, f"--help does not mention {option}"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_cpus_binds_every_thread_and_refuses_cpus_it_may_not_use(
    make_server: Callable[..., KVServer],
) -> None:
    """--cpus: every thread of the server, gRPC's and the store's included, runs on the
    CPUs given; a CPU the process may not use stops the start, saying which it may."""
    one = max(os.sched_getaffinity(0))
    srv = make_server("bound", args=["--cpus", str(one)]).start()
    with kvstore.Client(srv.unix_url, timeout=10) as c:  # threads that start on demand too
        key, status = c.put_chunk(
            namespace("cpus", 64), ROOT, tokens(16), payload(1024, 1), "bfloat16", (16, 32)
        )
        assert status.ok and c.get(key) is not None
    assert srv.proc is not None
    threads = thread_cpus(srv.proc.pid)
    assert len(threads) > 3, f"a serving kvstore-server has more threads than {threads}"
    stray = {name: cpus for name, cpus in threads.items() if cpus != {one}}
    assert not stray, f"threads not on CPU {one}: {stray}"

    bad = make_server("unbound", args=["--cpus", "4096"]).start(wait=False)
    rc, log = bad.wait(30), bad.log()
    assert rc == 2 and "not CPUs this process may run on" in log, f"exit {rc}:\n{log}"
    worse = make_server("negative", args=["--cpus", "-1"]).start(wait=False)
    rc, log = worse.wait(30), worse.log()
    assert rc == 2 and "CPU numbers, 0 or more" in log, f"exit {rc}:\n{log}"


def test_second_server_on_same_data_dir_is_refused(make_server: Callable[..., KVServer]) -> None:
    first = make_server("first").start()
    second = make_server("second", data_dir=first.data_dir).start(wait=False)
    rc = second.wait(30)
    log = second.log()
    assert rc == 1, f"second server exited with {rc}:\n{log}"
    assert "in use by another kvstore process" in log, log
    assert "Traceback" not in log, log
    with kvstore.Client(first.unix_url) as c:
        assert c.health(), "the first server must keep running"
    assert first.stop() == 0, first.log()


def test_sigterm_under_load_loses_no_acknowledged_chunk(
    make_server: Callable[..., KVServer],
) -> None:
    srv = make_server("load").start()
    acked: list[ChunkKey] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def writer(idx: int, url: str, shm: bool) -> None:
        ns = namespace(f"load-{idx}", 1024)
        with kvstore.Client(url, shm=shm, timeout=10) as c:
            i = 0
            while not stop.is_set():
                data = payload(64 * 1024, idx * 100_000 + i)
                try:
                    key, status = c.put_chunk(
                        ns, ROOT, tokens(64, idx * 10_000_000 + i * 64), data, "bfloat16", (64, 512)
                    )
                except KVStoreError as e:  # the server went away mid-call: not acknowledged
                    errors.append(str(e))
                    return
                if status.ok:
                    with lock:
                        acked.append(key)
                i += 1

    survivor = kvstore.Client(srv.unix_url, shm=True)  # lives through the restart below
    assert survivor.shm_active
    old_arena = survivor.info().shm_path
    threads = [
        threading.Thread(target=writer, args=(i, url, shm))
        for i, (url, shm) in enumerate(
            [(srv.unix_url, True), (srv.unix_url, True), (srv.tcp_url, False), (srv.tcp_url, False)]
        )
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(acked) < 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    rc = srv.stop(timeout=30)
    stop.set()
    for t in threads:
        t.join(30)
    assert rc == 0, f"SIGTERM exit code {rc}:\n{srv.log()}"
    assert len(acked) >= 50, f"only {len(acked)} puts acknowledged before SIGTERM: {errors}"
    assert "Traceback" not in srv.log(), srv.log()

    again = make_server("load", data_dir=srv.data_dir).start()  # same socket path
    with survivor as c:
        found = c.exists(acked)
        lost = [k.hex()[:16] for k, tiers in zip(acked, found, strict=True) if 2 not in tiers]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged chunks lost: {lost[:5]}"
        got = c.get(acked[-1])
        assert got is not None and len(got[1]) == 64 * 1024
        # The client found the new server's arena by itself.
        key, status = c.put_chunk(
            namespace("after-restart", 64), ROOT, tokens(16), payload(1024, 1), "bfloat16", (16, 32)
        )
        assert status.ok and c.shm_active and c.info().shm_path != old_arena
        assert c.get(key) is not None
    assert again.stop() == 0, again.log()


def test_runs_with_no_arguments(tmp_path: Path) -> None:
    """Defaults: data dir under XDG_DATA_HOME, socket under TMPDIR; the SDK finds the socket."""
    port = free_port()
    env = clean_env(
        {
            "XDG_DATA_HOME": str(tmp_path / "xdg"),
            "TMPDIR": str(tmp_path),
            "KVSTORE_LISTEN": f"127.0.0.1:{port}",  # tests never use fixed ports
            "KVSTORE_MEMORY_CAPACITY_BYTES": "32MiB",
        }
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.server.main"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        code = (
            "import time, kvstore\n"
            "c = kvstore.Client()\n"
            "for _ in range(300):\n"
            "    if c.health(): break\n"
            "    time.sleep(0.1)\n"
            "i = c.info(); print(c.url, i.tiers, i.shm_size, c.shm_active)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
        )
        assert done.returncode == 0, done.stderr
        assert f"unix://{tmp_path}/kvstore-" in done.stdout, done.stdout
        assert "('memory', 'disk') 33554432 True" in done.stdout, done.stdout
        assert (tmp_path / "xdg" / "kvstore" / "lmdb").is_dir(), "L2 not in the data dir"
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, out


@pytest.mark.skipif(not available("redis"), reason="redis-server is not installed")
def test_config_file_and_remote_tier(make_server: Callable[..., KVServer], tmp_path: Path) -> None:
    with RedisServer("redis") as redis:
        config = tmp_path / "kvstore.toml"
        config.write_text(
            f'chunk_tokens = 128\n\n[server]\nlog_format = "json"\n'
            f'piece_bytes = "256KiB"\n\n[remote]\nurl = "{redis.url}"\n'
        )
        srv = make_server("remote", args=["--config", str(config)]).start()
        with kvstore.Client(srv.tcp_url, shm=False) as c:
            info = c.info()
            assert info.tiers == ("memory", "disk", "remote"), info.tiers
            assert info.chunk_tokens == 128 and info.piece_bytes == 256 * 1024, info
            ns = namespace("remote", 8192)
            data = payload(128 * 8192, 9)  # 1 MiB: four Get pieces of 256 KiB
            key, status = c.put_chunk(ns, ROOT, tokens(128), data, "bfloat16", (128, 4096))
            assert status.ok, status
            got = c.get(key)
            assert got is not None and got[1] == data.tobytes()
        assert srv.stop() == 0, srv.log()
        assert srv.log().lstrip().startswith("{"), "log_format from [server] not applied"
