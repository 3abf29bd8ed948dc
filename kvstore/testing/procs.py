"""A test's child processes: stopping one with SIGSTOP (and knowing it has stopped), and
where its threads may run.

``kill(2)`` returns once the signal is queued, not once the process is stopped: a
server busy on another core goes on answering for a moment, so a test that sends
SIGSTOP and at once expects silence races it (a Lookup sent right after SIGSTOP was
answered in CI). ``freeze`` waits until the kernel reports the process stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["cpu_seconds", "freeze", "thaw", "thread_cpus"]


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name, from the state on: the name is
    "(comm)" and may hold spaces and parentheses, so it is cut at the last ")"."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def _state(pid: int) -> str:
    return _stat_fields(pid)[0]


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used so far, user and system, all its threads."""
    after = _stat_fields(pid)
    return (int(after[11]) + int(after[12])) / os.sysconf("SC_CLK_TCK")


def freeze(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGSTOP ``proc`` and wait until every one of its threads is stopped."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    tasks = Path(f"/proc/{proc.pid}/task")
    while True:
        try:
            if all(_state(int(t.name)) in "tT" for t in tasks.iterdir()):
                return
        except (FileNotFoundError, ProcessLookupError, ValueError):
            if proc.poll() is not None:
                raise AssertionError(f"process {proc.pid} exited instead of stopping") from None
        if time.monotonic() > deadline:
            raise AssertionError(f"process {proc.pid} not stopped {timeout} s after SIGSTOP")
        time.sleep(0.002)


def thaw(proc: subprocess.Popen[bytes]) -> None:
    """SIGCONT: the process runs again (callers wait for it to answer as they need)."""
    proc.send_signal(signal.SIGCONT)


def thread_cpus(pid: int) -> dict[str, set[int]]:
    """Each thread of a process ("name/tid") and the CPUs it may run on."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # ended meanwhile
            name = (task / "comm").read_text().strip()
            out[f"{name}/{task.name}"] = os.sched_getaffinity(int(task.name))
    return out
