"""Common code of the benchmark suites: records, limits, timing, progress, reports.

The machine these run on is shared and noisy, so no figure stands alone: every
throughput or latency is reported next to a limit measured in the same run, on
the same bytes, interleaved with it (memcpy into a preallocated buffer, a raw
LMDB get, loopback TCP, ...), and the ratio of the two is what a reader should
compare across runs. A timing never fails anything; targets are informative.

A suite is a module exposing ``run(quick: bool, progress: Progress) -> list[Record]``
(see ``benchmarks.__main__``).

The suite is one folder, ``benchmarks/`` at the top of the source checkout, imported
two ways: as the top-level package ``benchmarks`` (``python -m benchmarks`` from the
checkout's root, the tests) and, installed with kvstore, as ``kvstore.benchmarks``
(``python -m kvstore.benchmarks``, ``kvstore bench --suite``). Its modules import each
other relatively and name each other for child processes with ``module()``; where a
child runs (``child_cwd``, ``child_env``) and where a run writes its files
(``output_dir``) are decided here, once.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from kvstore import accel

T = TypeVar("T")

GB = 1e9  # throughputs are decimal GB/s, like every memory bandwidth figure
KiB = 1 << 10
MiB = 1 << 20
RECORD_KEYS = ("name", "value", "unit", "limit", "ratio")

# -- where the suite runs from and writes to ------------------------------------------------
PACKAGE = __name__.rpartition(".")[0]  # "benchmarks" in the checkout, or "kvstore.benchmarks"
HERE = Path(__file__).resolve().parent  # the suite's folder
OUTPUT_DIR = "kvstore-bench"  # outside a checkout, a run's files go to ./kvstore-bench/


def module(name: str) -> str:
    """The suite's module ``name`` by this package's name, for ``python -m`` or importlib:
    ``benchmarks.ttft_driver`` from the checkout, ``kvstore.benchmarks.ttft_driver`` installed."""
    return f"{PACKAGE}.{name}"


def checkout_of(suite_dir: Path = HERE) -> Path | None:
    """The kvstore source checkout whose ``benchmarks/`` folder ``suite_dir`` is, or None.

    An editable install (``pip install -e``) imports ``kvstore.benchmarks`` from the
    checkout's folder, so it is in one; a regular install (site-packages) is not.
    """
    root = suite_dir.parent
    if (
        suite_dir.name == "benchmarks"
        and (root / "pyproject.toml").is_file()
        and (root / "kvstore" / "__init__.py").is_file()
    ):
        return root
    return None


def output_dir(suite_dir: Path = HERE, cwd: Path | None = None) -> Path:
    """Where a run writes RESULTS.md, results/*.json and plots/*.png.

    In a checkout, beside the suite (``benchmarks/``, as committed); an installed copy
    never writes into site-packages: ``kvstore-bench/`` under ``cwd`` (default: the
    current directory), with the same layout.
    """
    if checkout_of(suite_dir) is not None:
        return suite_dir
    return (cwd or Path.cwd()) / OUTPUT_DIR


def child_cwd() -> Path | None:
    """The directory a child process running the suite's modules starts in.

    The top-level package ``benchmarks`` is importable only from the folder holding
    it (the checkout's root): a child runs there, with it on ``PYTHONPATH``
    (``child_env``) for the processes it spawns in turn. ``kvstore.benchmarks`` is
    importable wherever kvstore is: None, the child starts where we are.
    """
    return HERE.parent if PACKAGE == "benchmarks" else None


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: ours) for a child process, ``child_cwd()`` first on its PYTHONPATH
    when there is one."""
    out = dict(os.environ if env is None else env)
    root = child_cwd()
    if root is not None:
        out["PYTHONPATH"] = os.pathsep.join([str(root), out.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    return out


@dataclass
class Record:
    """One figure. ``ratio = value / limit`` (None without a limit).

    ``limit_name`` says what the limit is (measured in the same run); ``target``
    is the goal from the issue, as text ("ratio >= 0.5", "p50 < 1 ms"): reports
    show it, nothing asserts it.
    """

    name: str
    value: float
    unit: str
    limit: float | None = None
    ratio: float | None = None
    limit_name: str = ""
    target: str = ""
    notes: str = ""
    suite: str = ""

    def __post_init__(self) -> None:
        if self.ratio is None and self.limit:
            self.ratio = self.value / self.limit

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Progress(Protocol):
    """What a suite gets to show progress: wrap an iterable, like ``tqdm``."""

    def __call__(self, items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]: ...


class PlainProgress:
    """A tiny progress printer to stderr, for when tqdm is not installed."""

    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr

    def __call__(self, items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
        if total is None and isinstance(items, Sequence):
            total = len(items)
        if not self.enabled:
            yield from items
            return
        start, i = time.monotonic(), 0
        tty = self.stream.isatty()
        for i, item in enumerate(items, 1):
            yield item
            if tty:
                of = f"/{total}" if total else ""
                self.stream.write(f"\r  {desc}: {i}{of} ({time.monotonic() - start:.1f}s)")
                self.stream.flush()
        lead = "\r" if tty else ""
        self.stream.write(f"{lead}  {desc}: {i} done in {time.monotonic() - start:.1f}s\n")
        self.stream.flush()


class TqdmProgress:
    def __init__(self) -> None:
        import tqdm

        self._tqdm = tqdm.tqdm

    def __call__(self, items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
        bar = self._tqdm(
            items, desc=f"  {desc}", total=total, leave=False, file=sys.stderr, dynamic_ncols=True
        )
        try:
            yield from bar
        finally:
            bar.close()


def make_progress(enabled: bool = True) -> Progress:
    """tqdm on a terminal when installed, else the built-in printer (one line per phase)."""
    if enabled and sys.stderr.isatty():
        try:
            return TqdmProgress()
        except ImportError:
            pass
    return PlainProgress(enabled)


# -- timing -----------------------------------------------------------------------
def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


Case = Callable[[], object] | tuple[Callable[[], object], Callable[[], object]]


def interleaved(
    cases: Mapping[str, Case],
    reps: int,
    progress: Progress | None = None,
    desc: str = "",
    warmup: int = 1,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Seconds per call of each case, the cases taking turns within every repetition.

    Taking turns means a burst of noise from other tenants lands on all cases of
    a repetition alike, so the medians stay comparable. The order of the turns
    is shuffled every repetition, so no case always follows the same one (a
    read after a big write finds the caches dirtier than one after a read). A
    case is a callable, or ``(timed, undo)``: ``undo`` runs right after it,
    untimed (delete what a put stored, say). ``warmup`` repetitions come first,
    unrecorded.
    """
    out: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases)
    rng = random.Random(seed)
    reps_iter: Iterable[int] = range(warmup + reps)
    if progress is not None:
        reps_iter = progress(range(warmup + reps), desc=desc, total=warmup + reps)
    for i in reps_iter:
        rng.shuffle(order)
        for name in order:
            case = cases[name]
            fn, undo = case if isinstance(case, tuple) else (case, None)
            t = timed(fn)
            if undo is not None:
                undo()
            if i >= warmup:
                out[name].append(t)
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def touched(nbytes: int, fill: int = 1) -> np.ndarray:
    """A preallocated buffer with every page already faulted in."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(fill)
    return buf


def random_bytes(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def memcpy(src: np.ndarray, dst: np.ndarray) -> Callable[[], None]:
    """The copy limit: numpy's single-threaded memcpy of ``src`` into ``dst``."""

    def copy() -> None:
        np.copyto(dst, src)

    return copy


# -- loopback TCP -----------------------------------------------------------------------
def tcp_server() -> None:
    """The far end of ``LoopbackTcp`` (run in its own process): sink and source of bytes.

    A request is 9 bytes: ``W`` or ``R`` and a little-endian u64 length. ``W``: read
    that many bytes into a reused buffer, answer one byte. ``R``: send that many.
    """
    import socket
    import threading

    def serve(conn: socket.socket) -> None:
        buf = bytearray(0)
        data = memoryview(bytearray(0))
        head = bytearray(9)
        with conn:
            while _recv_exact(conn, memoryview(head)):
                op, n = head[:1], int.from_bytes(head[1:], "little")
                if op == b"W":
                    if len(buf) < n:
                        buf = bytearray(n)
                    if not _recv_exact(conn, memoryview(buf)[:n]):
                        return
                    conn.sendall(b"k")
                else:
                    if len(data) < n:
                        data = memoryview(random_bytes(n, n).tobytes())
                    conn.sendall(data[:n])

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    print(lsock.getsockname()[1], flush=True)
    while True:
        conn, _ = lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _recv_exact(sock: Any, view: memoryview) -> bool:
    import socket

    got = 0
    while got < len(view):
        # MSG_WAITALL: the kernel fills the whole view in one call when it can.
        n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if n == 0:
            return False
        got += n
    return True


class LoopbackTcp:
    """The network limit: Python sockets over 127.0.0.1, to and from another process.

    ``put(src)`` sends the bytes and waits for a one-byte acknowledgement; ``get_into(dst)``
    asks for ``len(dst)`` bytes and receives them straight into ``dst`` (``recv_into``, no
    intermediate object). No framing or parsing beyond 9 bytes per call: what any protocol
    over loopback TCP can do from Python on this machine.
    """

    def __init__(self) -> None:
        import socket

        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from {module('harness')} import tcp_server; tcp_server()"],
            stdout=subprocess.PIPE, cwd=child_cwd(), text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.close()
            raise RuntimeError("the loopback TCP server did not start")
        self.sock = socket.create_connection(("127.0.0.1", int(line)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ack = bytearray(1)

    def put(self, src: Any) -> None:
        view = memoryview(src).cast("B")
        self.sock.sendall(b"W" + len(view).to_bytes(8, "little"))
        self.sock.sendall(view)
        if not _recv_exact(self.sock, memoryview(self._ack)):
            raise RuntimeError("the loopback TCP server went away")

    def get_into(self, dst: Any) -> None:
        view = memoryview(dst).cast("B")
        self.sock.sendall(b"R" + len(view).to_bytes(8, "little"))
        if not _recv_exact(self.sock, view):
            raise RuntimeError("the loopback TCP server went away")

    def close(self) -> None:
        if getattr(self, "sock", None) is not None:
            self.sock.close()
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> LoopbackTcp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def size_label(nbytes: int) -> str:
    """64KiB, 4MiB, 1000B: record names; ``kvstore.config.parse_size`` reads them back."""
    if nbytes % MiB == 0:
        return f"{nbytes // MiB}MiB"
    return f"{nbytes // KiB}KiB" if nbytes % KiB == 0 else f"{nbytes}B"


# -- machine ----------------------------------------------------------------------
def machine_info() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except (OSError, ValueError):
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    info = {
        "cpu": cpu,
        "cores": f"{os.cpu_count()} ({usable} usable by this process)",
        "memory": mem,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "kvstore loops": accel.IMPL,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if checkout_of() is None:  # an installed copy: no commit of its own
        return info
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=HERE,
        )
        if rev.returncode == 0:
            info["commit"] = rev.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# -- reports ----------------------------------------------------------------------
def fmt(x: float | None) -> str:
    if x is None:
        return ""
    if x == 0 or 0.001 <= abs(x) < 1e6:
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return f"{x:.3e}"


def write_json(records: Sequence[Record], path: str | Path) -> None:
    """A list of records; every record has at least name, value, unit, limit and ratio."""
    Path(path).write_text(json.dumps([r.to_json() for r in records], indent=1) + "\n")


def markdown(records: Sequence[Record], machine: Mapping[str, str], title: str = "") -> str:
    lines = [f"# {title}", ""] if title else []
    lines += ["Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
    lines += [
        "Every ratio is value / limit, the limit measured in the same run; "
        "targets are goals, not pass/fail.",
        "",
        "| suite | case | value | unit | limit | ratio | limit is | target |",
        "| --- | --- | ---: | --- | ---: | ---: | --- | --- |",
    ]
    for r in records:
        cells = [
            r.suite,
            r.name,
            fmt(r.value),
            r.unit,
            fmt(r.limit),
            fmt(r.ratio),
            r.limit_name,
            r.target,
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    notes = [(r.name, r.notes) for r in records if r.notes]
    if notes:
        lines += ["", "Notes:", ""] + [f"- `{name}`: {text}" for name, text in notes]
    return "\n".join(lines) + "\n"


def write_markdown(
    records: Sequence[Record],
    path: str | Path,
    machine_info: Mapping[str, str],
    title: str = "Benchmark results",
) -> None:
    Path(path).write_text(markdown(records, machine_info, title))


# -- the suite's results document ------------------------------------------------------------
def _cells(r: Record) -> list[str]:
    return [r.name, fmt(r.value), r.unit, fmt(r.limit), fmt(r.ratio), r.limit_name, r.target]


def results_markdown(
    records: Sequence[Record],
    machine: Mapping[str, str],
    runs: Mapping[str, Mapping[str, Any]],
    plots: Sequence[str] = (),
    intro: str = "",
) -> str:
    """``RESULTS.md`` (``output_dir()``): the machine, the runs, the plots, one table per suite.

    ``runs`` maps a suite to what is known of its run (mode, date, seconds, skipped);
    ``plots`` are image paths relative to the document. Notes shared by several
    records are written once.
    """
    lines = ["# Benchmark results", ""]
    if intro:
        lines += [intro, ""]
    lines += ["Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
    lines += [
        "| suite | mode | date | seconds | load at start (1/5/15 min) | records |",
        "| --- | --- | --- | ---: | --- | ---: |",
    ]
    for suite, run in runs.items():
        n = sum(1 for r in records if r.suite == suite)
        state = run.get("skipped") or run.get("mode", "")
        lines.append(
            f"| {suite} | {state} | {run.get('date', '')} | {fmt(run.get('seconds'))} | "
            f"{run.get('load', '')} | {n} |"
        )
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    for suite in runs:
        mine = [r for r in records if r.suite == suite]
        if not mine:
            continue
        lines += [
            "",
            f"## {suite}",
            "",
            "| case | value | unit | limit | ratio | limit is | target |",
            "| --- | ---: | --- | ---: | ---: | --- | --- |",
        ]
        for r in mine:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |")
        grouped: dict[str, list[str]] = {}
        for r in mine:
            if r.notes:
                grouped.setdefault(r.notes, []).append(r.name)
        if grouped:
            lines += ["", "Notes:", ""]
            for text, names in grouped.items():
                lines.append("- " + ", ".join(f"`{n}`" for n in names) + f": {text}")
    return "\n".join(lines) + "\n"


def record_from_json(d: Mapping[str, Any]) -> Record:
    fields = Record.__dataclass_fields__
    return Record(**{k: v for k, v in d.items() if k in fields})


# -- a kvstore-server for a suite -------------------------------------------------------------
class ServerProcess:
    """``kvstore-server`` on a Unix socket in ``work``, L1 only, as a subprocess.

    No TCP listener and no LMDB: an L2 write-through would compete for the CPU with
    what the suites measure. ``url`` is ready once ``start()`` returns.
    """

    def __init__(self, work: Path, memory_bytes: int) -> None:
        self.socket = work / "kv.sock"
        self.url = f"unix://{self.socket}"
        self.log = work / "server.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.server.main", "--listen", "",
                 "--unix-socket", str(self.socket), "--data-dir", str(work / "data"),
                 "--memory-capacity", str(memory_bytes), "--no-disk", "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=child_cwd(),
            )  # fmt: skip

    def start(self, timeout: float = 120.0) -> ServerProcess:
        """Wait until the server answers its health check; raise with its log if it dies."""
        import kvstore

        deadline = time.monotonic() + timeout
        try:
            with kvstore.Client(self.url) as c:
                while not c.health(timeout=1):
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        text = self.log.read_text(errors="replace")[-3000:]
                        raise RuntimeError(f"kvstore-server did not start:\n{text}")
                    time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
