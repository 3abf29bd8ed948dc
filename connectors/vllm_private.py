"""The embedded default: a kvstore-server private to one vLLM engine.

An engine given no ``url`` runs its own server, started by whichever of its
processes (scheduler, workers) comes first and joined by the others; it dies
with the process that started it. Where things live:

- ``$TMPDIR/kvstore-$UID/engine-<id>/``: while the engine runs, ``start.lock``
  (held while its server starts) and ``server`` (the URL, for the engine's other
  processes). Removed when the engine stops; a dead engine's directory is
  removed by the next engine that starts.
- ``$XDG_CACHE_HOME/kvstore/vllm/slot-<N>/`` (default ``~/.cache/...``): the
  server's data dir (LMDB in ``lmdb/``), kept across restarts, and ``engine``,
  the namespace of the engine that used it last. Its socket is
  ``$TMPDIR/kvstore-$UID/vllm-<N>.sock``, a fixed path so that the ``kvstore``
  CLI can reach a running engine's store.

Why slots, not one server that concurrent engines join: a private server must
die with its engine (PR_SET_PDEATHSIG), or a killed engine leaves it running
with its arena in /dev/shm; a server shared by two engines would need a
reference count that a SIGKILL cannot release. So each running engine has its
own server and data dir, and the disk tier's lock on ``kvstore.lock`` (held by a
running server) says which slots are taken. Every chunk key holds the namespace
and every record is verified, so any engine may reuse any slot: an engine takes
a free slot last used by its own namespace (its cache after a restart), else
the lowest free one. The disk used is at most ``disk_capacity`` per slot, and
there are as many slots as engines ever ran at the same time.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from vllm.logger import init_logger

from kvstore.config import DiskConfig
from kvstore.errors import KVStoreError
from kvstore.protocol import default_socket_path
from kvstore.sockets import untrusted_reason

from .vllm_config import ConnectorConfig

log = init_logger("vllm.kvstore.connector")

MAX_SLOTS = 16  # more engines than this at once get a temporary cache (warned about)
START_TIMEOUT_S = 30.0
DISK_LOCK_FILE = "kvstore.lock"  # kvstore/engine/tiers/disk.py LOCK_FILE, in DiskConfig's LMDB dir
ENGINE_PREFIX = "engine-"


def run_root() -> str:
    """Where sockets and per-engine rendezvous files live: the server's own default."""
    return os.path.dirname(default_socket_path())


def cache_root() -> str:
    """``$XDG_CACHE_HOME/kvstore/vllm``; the spec says a relative value is ignored."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvstore", "vllm")


def slot_dir(n: int) -> str:
    return os.path.join(cache_root(), f"slot-{n}")


def slot_socket(n: int) -> str:
    return os.path.join(run_root(), f"vllm-{n}.sock")


@dataclass
class PrivateServer:
    """A server this process started; ``stop`` ends it and removes the engine's directory."""

    proc: subprocess.Popen[bytes]
    url: str
    engine_dir: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        # A temporary data dir lives in it: gone with the engine, as promised.
        shutil.rmtree(self.engine_dir, ignore_errors=True)


def open_private(
    cfg: ConnectorConfig,
    engine_id: str,
    tag: str,
    describe: str,
    cpus: frozenset[int] | None = None,
) -> tuple[str, PrivateServer | None]:
    """The URL of this engine's private server, and the server if this process started it.

    ``tag`` names the engine's namespace (model, dtype, KV layout, parallelism):
    a slot last used by the same tag is preferred, so a restart finds its cache.
    ``cpus``: where a server started here runs (``kvstore-server --cpus``): a CPU
    worker's spare cores (``vllm_cpus.spare_cpus``); it would otherwise inherit the
    worker's binding, and promote and copy on the compute core.
    """
    run = run_root()
    os.makedirs(run, mode=0o700, exist_ok=True)
    # Whoever can change this directory could plant a ``server`` file naming their own
    # socket, and this engine would send its KV there: the server's own rule, checked
    # before anything in it is read or removed.
    why = untrusted_reason(run)
    if why:
        raise KVStoreError(
            f"the embedded kvstore-server cannot use {run}: {why}. Another user could "
            "swap its socket; fix the directory, set TMPDIR, or give a url"
        )
    name = ENGINE_PREFIX + engine_id[:16]
    sweep_engine_dirs(run, keep=name)
    engine_dir = os.path.join(run, name)
    with _locked_dir(engine_dir) as _:
        url = _read(os.path.join(engine_dir, "server"))
        if url and _healthy(url):
            return url, None
        if cfg.data_dir:
            sock = os.path.join(engine_dir, "kvstore.sock")
            server = _start(cfg, engine_dir, cfg.data_dir, sock, cpus)
            _announce(server, cfg, cfg.data_dir, "kept across restarts")
        elif not cfg.persist:
            server = _start_temporary(cfg, engine_dir, cpus)
        else:
            server = _start_in_slot(cfg, engine_dir, tag, describe, cpus)
        _write(os.path.join(engine_dir, "server"), server.url)
    return server.url, server


def _start_temporary(
    cfg: ConnectorConfig, engine_dir: str, cpus: frozenset[int] | None = None
) -> PrivateServer:
    data = os.path.join(engine_dir, "data")
    server = _start(cfg, engine_dir, data, os.path.join(engine_dir, "kvstore.sock"), cpus)
    _announce(server, cfg, data, "temporary: removed when the engine stops")
    return server


def _start_in_slot(
    cfg: ConnectorConfig,
    engine_dir: str,
    tag: str,
    describe: str,
    cpus: frozenset[int] | None = None,
) -> PrivateServer:
    root = cache_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    # One engine at a time picks and starts, until its server holds the slot's disk
    # lock: two engines never see the same slot free.
    with _locked_file(os.path.join(root, "slots.lock")):
        free = [n for n in range(MAX_SLOTS) if not _slot_busy(n)]
        if not free:
            log.warning(
                "kvstore: all %d cache slots in %s are in use by running engines; this "
                "engine's cache is temporary",
                MAX_SLOTS,
                root,
            )
            return _start_temporary(cfg, engine_dir, cpus)
        mine = [n for n in free if _read(os.path.join(slot_dir(n), "engine")) == tag]
        n = (mine or free)[0]
        data = slot_dir(n)
        server = _start(cfg, engine_dir, data, slot_socket(n), cpus)
        _write(os.path.join(data, "engine"), f"{tag}\n{describe}\n")
    _announce(server, cfg, data, "kept across restarts; persist=false for a temporary one")
    return server


def _slot_busy(n: int) -> bool:
    """A running server holds the slot's disk lock (or answers on its socket)."""
    lock = os.path.join(DiskConfig().resolved_path(slot_dir(n)), DISK_LOCK_FILE)
    return _lock_held(lock) or _listening(slot_socket(n))


def _start(
    cfg: ConnectorConfig,
    engine_dir: str,
    data: str,
    sock: str,
    cpus: frozenset[int] | None = None,
) -> PrivateServer:
    url = f"unix://{sock}"
    cmd = [
        sys.executable,
        "-m",
        "kvstore.server.main",
        "--listen",
        "",
        "--unix-socket",
        sock,
        "--data-dir",
        data,
        "--memory-capacity",
        cfg.memory_capacity,
        "--disk-capacity",
        cfg.disk_capacity,
        "--log-level",
        "warning",
    ]
    if cfg.chunk_tokens:
        cmd += ["--chunk-tokens", str(cfg.chunk_tokens)]
    if cpus:
        cmd += ["--cpus", ",".join(map(str, sorted(cpus)))]
    proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    server = PrivateServer(proc, url, engine_dir)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise KVStoreError(
                f"the private kvstore-server did not start (exit status {proc.returncode}; "
                f"its messages are above): {' '.join(cmd)}"
            )
        time.sleep(0.1)
    return server


def _announce(server: PrivateServer, cfg: ConnectorConfig, data: str, kept: str) -> None:
    log.info(
        "kvstore: started a private kvstore-server at %s: L1 %s of shared memory, "
        "L2 up to %s in %s (%s); see it with `kvstore --url %s stats`",
        server.url,
        cfg.memory_capacity,
        cfg.disk_capacity,
        data,
        kept,
        server.url,
    )


# -- leftovers ---------------------------------------------------------------------


def sweep_engine_dirs(run: str, keep: str = "") -> list[str]:
    """Remove the directories of engines that are gone; return their paths.

    Gone: nobody holds its ``start.lock`` (no server is starting), no server answers
    on its sockets, and no server holds the disk lock of a data dir inside (the
    layout before slots kept every engine's L2 there). A live one is never touched.
    """
    removed: list[str] = []
    try:
        names = os.listdir(run)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(run, name)
        if not name.startswith(ENGINE_PREFIX) or name == keep or not os.path.isdir(path):
            continue
        try:
            fd = os.open(os.path.join(path, "start.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:
            if not _engine_alive(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("kvstore: removed %d directories of engines that are gone", len(removed))
    return removed


def _engine_alive(path: str) -> bool:
    sockets = [os.path.join(path, "kvstore.sock")]
    url = _read(os.path.join(path, "server"))
    if url.startswith("unix://"):
        sockets.append(url.removeprefix("unix://"))
    data_lock = os.path.join(DiskConfig().resolved_path(os.path.join(path, "data")), DISK_LOCK_FILE)
    return any(_listening(s) for s in sockets) or _lock_held(data_lock)


# -- small helpers -------------------------------------------------------------------


@contextlib.contextmanager
def _locked_file(path: str) -> Iterator[IO[str]]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield f


@contextlib.contextmanager
def _locked_dir(path: str) -> Iterator[IO[str]]:
    """Hold ``path/start.lock``; a sweep may remove the directory until we hold it."""
    lock = os.path.join(path, "start.lock")
    while True:
        os.makedirs(path, mode=0o700, exist_ok=True)
        try:
            f = open(lock, "a")  # noqa: SIM115 (closed below or by the caller's with)
        except FileNotFoundError:
            continue  # removed between makedirs and open
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            same = os.stat(lock).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()  # we locked a file a sweep has since removed: start over
    with f:
        yield f


def _lock_held(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False  # no lock file: no server ever opened it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also releases the lock if we got it
    return False


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def _healthy(url: str) -> bool:
    from kvstore.sdk import Client

    try:
        with Client(url, timeout=1.0, shm=False) as c:
            return bool(c.health(timeout=1.0))
    except Exception:
        return False


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the engine process that started us dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
