"""Common code of the benchmark suites: records, limits, timing, progress, reports.

The machine these run on is shared and noisy, so no figure stands alone: every
throughput or latency is reported next to a limit measured in the same run, on
the same bytes, interleaved with it (memcpy into a preallocated buffer, a raw
LMDB get, loopback TCP, ...), and the ratio of the two is what a reader should
compare across runs. A timing never fails anything; targets are informative.

A suite is a module exposing ``run(quick: bool, progress: Progress) -> list[Record]``
(see ``benchmarks.__main__``).
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

T = TypeVar("T")

GB = 1e9  # throughputs are decimal GB/s, like every memory bandwidth figure
MiB = 1 << 20
RECORD_KEYS = ("name", "value", "unit", "limit", "ratio")


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


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB}MiB" if nbytes % MiB == 0 else f"{nbytes}B"


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
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
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
