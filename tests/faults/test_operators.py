"""Careless operators and hostile neighbours: what the server finds on disk when it starts.

Each scenario starts a real kvstore-server on files that an operator (or another
local user) got wrong: a socket directory someone else controls, a truncated
``data.mdb`` or one with zeroed pages (what a crash of the host can leave), a data
dir whose ``kvstore.lock`` was deleted under a running server,
an ``--shm-path`` naming a file that is not an arena. The server must refuse with a
message saying what is wrong (exit 1; 2 for a bad setting) and leave every file it
did not create as it was: never start and then crash, never adopt or delete someone
else's file. Also a ``Namespace`` built with a dict, which the server used to
reject on every lookup, and the SDK's side of the squatted socket directory.

Tests run as root in CI; the "owned by another user" cases chown to nobody and are
left out when not root.
"""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvstore
from kvstore.errors import ConfigError, InvalidArgument, KVStoreError
from kvstore.keys import ROOT, ChunkKey, Namespace, chunk_key, tokens_to_bytes
from kvstore.testing.server import KVServer
from tests.helpers import payload_bytes

MiB = 1 << 20
NOBODY = 65534
ROOT_USER = os.geteuid() == 0
SERVING = health_pb2.HealthCheckResponse.SERVING


def _outcome(srv: KVServer, timeout: float = 30.0) -> int | None:
    """Start ``srv``: its exit status if it gives up, None if it serves (TCP health) instead."""
    srv.start(wait=False)
    assert srv.proc is not None
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if srv.proc.poll() is not None:
                return srv.wait()
            with contextlib.suppress(grpc.RpcError):
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == SERVING:
                    return None
            time.sleep(0.05)
    raise AssertionError(f"kvstore-server neither served nor exited in {timeout} s:\n{srv.log()}")


def _stop_if_serving(srv: KVServer, rc: int | None) -> str:
    """What happened, in words; a server that started (wrongly) is stopped first."""
    if rc is None:
        srv.stop()
        return "started"
    return f"exit {rc}"


def _nobody(path: Path) -> Path:
    os.chown(path, NOBODY, NOBODY)
    return path


class _DefaultSocketServer(KVServer):
    """A server left to its default Unix socket ($TMPDIR/kvstore-$UID/kvstore.sock)."""

    def command(self) -> list[str]:
        cmd = super().command()
        i = cmd.index("--unix-socket")
        return cmd[:i] + cmd[i + 2 :]


# -- item 6: the socket's directory -----------------------------------------------------
def test_socket_directory_others_control_is_refused(
    make_server: Callable[..., KVServer],
    tmp_path: Path,
    record: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cases: dict[str, Path] = {}  # what is wrong -> the socket path given to the server
    wide = tmp_path / "wide"
    wide.mkdir()
    wide.chmod(0o777)
    cases["writable by others"] = wide / "kv.sock"
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    cases["a symlink"] = tmp_path / "link" / "kv.sock"
    if ROOT_USER:
        cases["owned by another user"] = _nobody(_mkdir(tmp_path / "other", 0o700)) / "kv.sock"
        parent = _nobody(_mkdir(tmp_path / "parent", 0o755))
        cases["in a directory another user owns"] = _mkdir(parent / "mine", 0o700) / "kv.sock"
    outcomes: dict[str, str] = {}
    logs: dict[str, str] = {}
    for i, (why, sock) in enumerate(cases.items()):
        srv = make_server(f"sq{i}", args=["--unix-socket", str(sock), "--no-disk"])
        outcomes[why] = _stop_if_serving(srv, _outcome(srv))
        logs[why] = srv.log()

    # The default directory, squatted before the server's first start...
    uid = os.getuid()
    squat_tmp = _mkdir(tmp_path / "squat-tmp", 0o700)
    squatted = _mkdir(squat_tmp / f"kvstore-{uid}", 0o777)
    if ROOT_USER:
        _nobody(squatted)
    squatter = _DefaultSocketServer(tmp_path, "default-squatted", args=["--no-disk"])
    squatter.env["TMPDIR"] = str(squat_tmp)
    try:
        outcomes["the default directory, squatted"] = _stop_if_serving(squatter, _outcome(squatter))
    finally:
        squatter.stop(signal.SIGKILL)
    logs["the default directory, squatted"] = squatter.log()
    # ... and made by the server itself: 0700, and used again at the next start.
    fresh_tmp = _mkdir(tmp_path / "fresh-tmp", 0o700)
    fresh = _DefaultSocketServer(tmp_path, "default-fresh", args=["--no-disk"])
    fresh.env["TMPDIR"] = str(fresh_tmp)
    fresh.socket = fresh_tmp / f"kvstore-{uid}" / "kvstore.sock"
    modes, restarts = [], 0
    try:
        for _ in range(2):
            fresh.start()
            modes.append(stat.S_IMODE(os.lstat(fresh.socket.parent).st_mode))
            restarts += fresh.stop() == 0
    finally:
        fresh.stop(signal.SIGKILL)

    # The SDK does not dial its default socket in a directory it cannot trust: it would
    # hand its bearer token (and its puts) to whoever listens there.
    monkeypatch.setattr(tempfile, "tempdir", str(squat_tmp))
    monkeypatch.delenv("KVSTORE_URL", raising=False)
    heard = _listen(squatted / "kvstore.sock")
    client_outcome = "connected"
    try:
        with (
            kvstore.Client(token="s3cret-token", timeout=2.0) as c,
            contextlib.suppress(KVStoreError),
        ):
            c.info()
    except ConfigError as e:
        client_outcome = f"refused: {e}"
    finally:
        heard.stop()
    refused = [w for w, o in outcomes.items() if o == "exit 1"]
    record(
        "Security",
        "socket directory squatted",
        f"kvstore-server started on a Unix socket whose directory is {', '.join(cases)}, and on "
        "its default socket with $TMPDIR/kvstore-$UID made beforehand by another user; the SDK "
        "pointed at that default socket with a token, a listener of the squatter's there",
        faults=len(outcomes) + 1,
        requests=len(outcomes) + 3,
        notes=f"{len(refused)} of {len(outcomes)} refused at start; SDK: "
        f"{client_outcome.split(':')[0]}, the squatter heard {heard.connections} connection(s), "
        f"{heard.bytes} bytes; a fresh default directory is {oct(modes[0]) if modes else '?'}",
    )
    for why, outcome in outcomes.items():
        assert outcome == "exit 1", f"{why}: the server must refuse (exit 1), got {outcome}"
        assert "cannot start" in logs[why] and "unix socket" in logs[why], (why, logs[why])
        assert "Traceback" not in logs[why], logs[why]
    assert "owned by uid" in logs.get("owned by another user", "owned by uid"), logs
    assert "writable by" in logs["writable by others"], logs["writable by others"]
    assert "symlink" in logs["a symlink"], logs["a symlink"]
    assert modes == [0o700, 0o700] and restarts == 2, (modes, restarts, fresh.log())
    assert client_outcome.startswith("refused") and str(squatted) in client_outcome, client_outcome
    assert heard.connections == 0 and heard.bytes == 0, "the client talked to the squatter"


def _mkdir(path: Path, mode: int) -> Path:
    path.mkdir()
    path.chmod(mode)  # not left to the umask
    return path


class _Listener:
    """A squatter's Unix socket: counts who connects and what they send."""

    def __init__(self, path: Path) -> None:
        self.connections = 0
        self.bytes = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(0.5)
                with contextlib.suppress(OSError):
                    while data := conn.recv(65536):
                        self.bytes += len(data)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def _listen(path: Path) -> _Listener:
    return _Listener(path)


# -- item 9: a truncated data.mdb ---------------------------------------------------------
N_CHUNKS = 16  # of 1 MiB: data.mdb is ~16 MiB, half of it cut off


def _shm_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"kvstore-test-{os.getpid()}-{secrets.token_hex(4)}")


def _put_chunks(c: kvstore.Client, layout: str, n: int) -> list[ChunkKey]:
    ns = Namespace(model="faults-operators", dtype="bfloat16", layout=layout)
    keys = []
    for i in range(n):
        toks = list(range(i * 256 + 1, i * 256 + 257))
        key, status = c.put_chunk(
            ns, ROOT, toks, payload_bytes(MiB, i), "bfloat16", (256, MiB // 512)
        )
        assert status.ok, status
        keys.append(key)
    return keys


def test_truncated_data_mdb_is_refused_at_every_start(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    shm = _shm_path()
    srv = make_server("trunc", args=["--shm-path", shm])
    srv.start()
    with kvstore.Client(srv.unix_url, shm=False) as c:
        keys = _put_chunks(c, "trunc", N_CHUNKS)
    assert srv.stop() == 0, srv.log()  # write-through: every chunk is in data.mdb now
    data = srv.data_dir / "lmdb" / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    outcomes, reads = [], 0
    try:
        for _ in range(2):  # a crash loop shows on every restart
            rc = _outcome(srv)
            if rc is None:  # it started: read what it says it has, as clients would
                with kvstore.Client(srv.unix_url, shm=False, timeout=5.0) as c:
                    for key in keys:
                        try:
                            c.get(key)
                            reads += 1
                        except KVStoreError:
                            break
                time.sleep(0.5)
                rc = srv.proc.poll() if srv.proc is not None else None
                rc = srv.stop() if rc is None else srv.wait()
                outcomes.append(f"started, {reads} reads, then exit {rc}")
            else:
                outcomes.append(f"exit {rc}")
        log = srv.log()
        arena_left = os.path.exists(shm)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm)
    record(
        "Operators",
        "data.mdb truncated to half",
        f"{N_CHUNKS} chunks of 1 MiB written down to LMDB, the server stopped, data.mdb "
        f"truncated from {size // MiB} MiB to half, the server started twice with an explicit "
        "--shm-path",
        faults=1,
        requests=N_CHUNKS + reads,
        notes=f"starts: {'; '.join(outcomes)}; arena left behind: {arena_left}",
    )
    assert outcomes == ["exit 1", "exit 1"], (
        f"the server must refuse a truncated data.mdb at start (exit 1), got {outcomes}:\n{log}"
    )
    assert "truncated" in log and str(data) in log and "move the directory aside" in log, log
    assert "Traceback" not in log, log
    assert not arena_left, f"the refused server left its arena {shm} behind"


def _tree_pages(data: Path) -> dict[str, list[int]]:
    """data.mdb's pages by what their own header says they are (LMDB 0.9: the page
    number, then flags at byte 10: 1 branch, 2 leaf, 4 the first page of a big value)."""
    raw, psize = data.read_bytes(), resource.getpagesize()
    kinds: dict[str, list[int]] = {"branch": [], "leaf": [], "overflow": []}
    names = {1: "branch", 2: "leaf", 4: "overflow"}
    for pg in range(2, len(raw) // psize):
        at = pg * psize
        flags = int.from_bytes(raw[at + 10 : at + 12], "little") & 7
        if int.from_bytes(raw[at : at + 8], "little") == pg and flags in names:
            kinds[names[flags]].append(pg)
    return kinds


def _spread(pages: list[int], n: int) -> list[int]:
    return pages if len(pages) <= n else [pages[i * len(pages) // n] for i in range(n)]


def test_zeroed_lmdb_pages_are_refused_or_missed_never_a_crash(
    make_server: Callable[..., KVServer], tmp_path: Path, record: Callable[..., Any]
) -> None:
    srv = make_server("pages", args=["--no-shm"])
    srv.start()
    ns = Namespace(model="faults-operators", dtype="bfloat16", layout="pages")
    chunks: dict[ChunkKey, bytes] = {}
    with kvstore.Client(srv.unix_url, shm=False) as c:
        for i in range(48):  # ~22 leaf pages of index entries, records in big values
            payload = payload_bytes(16 * 1024, i)
            key, status = c.put_chunk(
                ns, ROOT, list(range(i * 256 + 1, i * 256 + 257)), payload, "bfloat16", (256, 32)
            )
            assert status.ok, status
            chunks[key] = payload
    assert srv.stop() == 0, srv.log()
    kinds = _tree_pages(srv.data_dir / "lmdb" / "data.mdb")
    assert kinds["branch"] and kinds["leaf"] and kinds["overflow"], kinds
    targets = [
        (kind, pg)
        for kind, n in (("branch", 8), ("leaf", 8), ("overflow", 3))
        for pg in _spread(kinds[kind], n)
    ]
    outcomes: dict[str, int] = {"refused": 0, "served": 0, "crashed": 0, "other": 0}
    wrong = lost = errors = 0
    notes: list[str] = []
    for i, (kind, pg) in enumerate(targets):
        copy = tmp_path / f"zeroed-{i}"
        shutil.copytree(srv.data_dir, copy)
        with open(copy / "lmdb" / "data.mdb", "r+b") as f:
            f.seek(pg * resource.getpagesize())
            f.write(bytes(resource.getpagesize()))
        run = make_server(f"zeroed-{i}", data_dir=copy, args=["--no-shm"])
        rc = _outcome(run)
        if rc is None:
            with kvstore.Client(run.unix_url, shm=False, timeout=5.0) as c:
                for key, payload in chunks.items():
                    try:
                        got = c.get(key)
                    except KVStoreError as e:
                        errors += 1
                        notes.append(f"{kind} page {pg}: get failed: {e}")
                        continue
                    lost += got is None
                    wrong += got is not None and got[1] != payload
            rc = run.proc.poll() if run.proc is not None else None
            rc = run.stop() if rc is None else run.wait()
            outcomes["served" if rc == 0 else "crashed" if rc < 0 else "other"] += 1
        else:
            refused = rc == 1 and "move the directory aside" in run.log()
            outcomes["refused" if refused else "crashed" if rc < 0 else "other"] += 1
        if rc not in (0, 1):
            notes.append(f"{kind} page {pg}: exit {rc}: {run.log()[-300:]}")
    record(
        "Operators",
        "data.mdb pages zeroed",
        f"48 chunks written down to LMDB, the server stopped; one page of data.mdb zeroed at a "
        f"time in a copy ({len(targets)} pages: B-tree branches, leaves, first pages of big "
        "values), a server started on each copy and every chunk read back",
        faults=len(targets),
        requests=outcomes["served"] * len(chunks),
        wrong=wrong,
        notes=", ".join(f"{v} {k}" for k, v in outcomes.items())
        + f"; {lost} chunks missed (their pages zeroed), {errors} reads failed",
    )
    assert outcomes["crashed"] == 0 and outcomes["other"] == 0, notes
    assert wrong == 0, "a zeroed page must never be served as a chunk's bytes"
    assert errors == 0, f"a damaged record must be a miss, not an error: {notes[:3]}"


# -- item 10a: the data dir's lock --------------------------------------------------------
def test_second_server_is_refused_after_the_lock_file_was_deleted(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    first = make_server("first").start()
    lock = first.data_dir / "lmdb" / "kvstore.lock"
    assert lock.exists(), "the disk tier's lock file is not where this test looks"
    outcomes: dict[str, str] = {}
    lock.unlink()
    second = make_server("second", data_dir=first.data_dir)
    outcomes["kvstore.lock deleted"] = _stop_if_serving(second, _outcome(second))
    log_deleted = second.log()
    lock.write_text("12345\n")  # deleted, then made again by hand (or by a careless script)
    third = make_server("third", data_dir=first.data_dir)
    outcomes["kvstore.lock made again"] = _stop_if_serving(third, _outcome(third))
    with kvstore.Client(first.unix_url, shm=False) as c:
        first_ok = c.health()
    first_rc = first.stop()
    after = _stop_if_serving(second, _outcome(second))  # the lock went with the first server
    record(
        "Operators",
        "lock file deleted under a running server",
        "a server running on a data dir; its kvstore.lock deleted (and then made again); a "
        "second server started on the same data dir each time; then again once the first "
        "stopped",
        faults=2,
        requests=3,
        notes=f"{'; '.join(f'{k}: {v}' for k, v in outcomes.items())}; after the first "
        f"stopped: {after}",
    )
    for why, outcome in outcomes.items():
        assert outcome == "exit 1", f"{why}: a second server on the data dir must be refused"
    assert "in use by another kvstore process" in log_deleted, log_deleted
    assert first_ok and first_rc == 0, first.log()
    assert after == "started", "once the first server stopped, the data dir must be free"


# -- item 10b: --shm-path naming a file that is not an arena ------------------------------
def test_shm_path_naming_a_file_that_is_not_an_arena_is_refused(
    make_server: Callable[..., KVServer], tmp_path: Path, record: Callable[..., Any]
) -> None:
    precious = tmp_path / "precious.db"
    precious.write_bytes(payload_bytes(MiB, 7))
    empty = tmp_path / "empty"
    empty.touch()
    target = tmp_path / "target"
    target.write_bytes(b"not an arena\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    cases = {"a file with data": precious, "an empty file": empty, "a symlink to a file": link}
    before = {why: (p.read_bytes(), os.lstat(p).st_ino) for why, p in cases.items()}
    outcomes: dict[str, str] = {}
    logs: dict[str, str] = {}
    for i, (why, path) in enumerate(cases.items()):
        srv = make_server(f"shm{i}", args=["--shm-path", str(path), "--no-disk"])
        outcomes[why] = _stop_if_serving(srv, _outcome(srv))
        logs[why] = srv.log()
    kept = {
        why: os.path.lexists(p) and (p.read_bytes(), os.lstat(p).st_ino) == before[why]
        for why, p in cases.items()
    }

    # A server's own arena at an explicit path: a second server is refused while it
    # runs; after a kill -9, the next server takes the stale arena over and removes it.
    shm = _shm_path()
    try:
        owner = make_server("arena-a", args=["--shm-path", shm, "--no-disk"]).start()
        rival = make_server("arena-b", args=["--shm-path", shm, "--no-disk"])
        outcomes["a live server's arena"] = _stop_if_serving(rival, _outcome(rival))
        live_log = rival.log()
        owner.stop(signal.SIGKILL)
        stale_left = os.path.exists(shm)
        heir = make_server("arena-c", args=["--shm-path", shm, "--no-disk"])
        outcomes["a killed server's arena"] = _stop_if_serving(heir, _outcome(heir))
        removed = not os.path.exists(shm)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm)
    record(
        "Operators",
        "--shm-path names a file that is not an arena",
        f"kvstore-server started with --shm-path naming {', '.join(cases)}; a live server's "
        "arena; a kill -9'd server's arena",
        faults=len(outcomes),
        requests=len(outcomes),
        notes="; ".join(f"{k}: {v}" for k, v in outcomes.items())
        + f"; files kept intact: {sum(kept.values())} of {len(kept)}",
    )
    for why in cases:
        assert outcomes[why] == "exit 2", f"{why}: must be refused as a bad --shm-path"
        assert kept[why], f"{why}: the server changed or deleted a file it did not create"
        assert "not an arena" in logs[why] or "symlink" in logs[why], logs[why]
    assert outcomes["a live server's arena"] == "exit 1" and "in use" in live_log, live_log
    assert stale_left, "kill -9 should have left the arena behind (the test's premise)"
    assert outcomes["a killed server's arena"] == "started", "a stale arena must be taken over"
    assert removed, "the server that took over a stale arena must remove it at shutdown"


# -- item 10c: Namespace(extra=...) -------------------------------------------------------
def test_namespace_extra_given_as_a_dict_works_through_the_server(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    base: dict[str, Any] = {"model": "faults-operators", "dtype": "bfloat16", "layout": "extra"}
    variants = {
        "a dict": Namespace(**base, extra={"quant": "awq", "adapter": "a1"}),  # type: ignore[arg-type]
        "unsorted pairs": Namespace(**base, extra=(("quant", "awq"), ("adapter", "a1"))),
        "sorted pairs": Namespace(**base, extra=(("adapter", "a1"), ("quant", "awq"))),
    }
    srv = make_server("ns", args=["--chunk-tokens", "16", "--granularity", "4", "--no-disk"])
    srv.start()
    matched: dict[str, str] = {}
    with kvstore.Client(srv.unix_url, shm=False) as c:
        for i, (why, ns) in enumerate(variants.items()):
            toks = list(range(100 * i + 1, 100 * i + 17))
            try:
                key, status = c.put_chunk(
                    ns, ROOT, toks, payload_bytes(16 * 64, i), "bfloat16", (16, 32)
                )
                found = c.lookup(ns, toks).matched_tokens
                ok = key == chunk_key(ROOT, ns.fingerprint, tokens_to_bytes(toks))
                matched[why] = f"{found} of 16 tokens" + ("" if ok and status.ok else ", bad put")
            except KVStoreError as e:
                matched[why] = f"{type(e).__name__}: {e}"
    bad = {
        "a value that is not a string": {"quant": 4},
        "a name given twice": (("quant", "awq"), ("quant", "gptq")),
        "not pairs": "quant=awq",
    }
    refusals: dict[str, str] = {}
    for why, extra in bad.items():
        try:
            Namespace(**base, extra=extra)  # type: ignore[arg-type]
            refusals[why] = "accepted"
        except InvalidArgument as e:
            refusals[why] = str(e)
    fingerprints = {ns.fingerprint for ns in variants.values()}
    record(
        "Operators",
        "Namespace extra given as a dict",
        "a chunk put and looked up under a Namespace whose extra is a dict, unsorted pairs, "
        f"sorted pairs; Namespace built with {', '.join(bad)}",
        requests=2 * len(variants),
        fuzzed=len(bad),
        notes="; ".join(f"{k}: {v}" for k, v in matched.items())
        + f"; {len(fingerprints)} fingerprint(s); refused at construction: "
        f"{sum(v != 'accepted' for v in refusals.values())} of {len(bad)}",
    )
    for why, outcome in matched.items():
        assert outcome == "16 of 16 tokens", f"{why}: {outcome}"
    assert len(fingerprints) == 1, "the same pairs must give the same namespace"
    assert len({ns for ns in variants.values()}) == 1, "and compare (and hash) equal"
    for why, msg in refusals.items():
        assert msg != "accepted" and "Namespace.extra" in msg, f"{why}: {msg}"
