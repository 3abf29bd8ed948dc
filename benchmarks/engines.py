"""vLLM engines for the suites that time prompts through them (connector, replay).

An engine takes about a minute to build here, so each suite keeps one alive per
configuration in a driver process (``benchmarks.ttft_driver``, ``benchmarks.replay``)
and feeds it prompts: JSON commands on its stdin, one per line ({"quit": true} ends
it); on its stdout vLLM's log, one ``@@ready {}`` line once the engine is built, and
one ``@@ttft {json}`` line per prompt. Everything a driver prints goes to a log file
in the suite's scratch directory, which is kept when the suite fails.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .harness import child_cwd, child_env

MARK_READY = "@@ready"
MARK_TTFT = "@@ttft"
START_S = 900.0  # building an engine: about a minute here, several on a busy machine
REQUEST_S = 900.0  # one prompt: a cold 16k-token prefill takes minutes on 2 cores


def kv_bytes_per_token(layers: int, hidden: int, heads: int, kv_heads: int, dtype: str) -> int:
    """KV bytes a token of a dense Llama: K and V of every layer's KV heads."""
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    return layers * 2 * kv_heads * (hidden // heads) * itemsize


def emit(mark: str, payload: dict[str, Any]) -> None:
    """Driver side: one protocol line, in one write (the engine core logs into the same
    pipe from another process)."""
    os.write(sys.stdout.fileno(), f"{mark} {json.dumps(payload)}\n".encode())


CONNECTOR_CONFIG_ENV = "KVSTORE_BENCH_CONNECTOR_CONFIG"


def kvstore_connector(url: str) -> dict[str, Any]:
    """The ``kv_transfer_config`` of an engine using kvstore at ``url`` (shared memory),
    plus the connector settings in ``$KVSTORE_BENCH_CONNECTOR_CONFIG`` (a JSON object,
    e.g. ``{"save_mode": "async"}``): a variant measured against the same limits."""
    extra: dict[str, Any] = {"url": url, "shm": "on"}
    raw = os.environ.get(CONNECTOR_CONFIG_ENV, "")
    if raw:
        more = json.loads(raw)
        if not isinstance(more, dict):
            raise ValueError(f"{CONNECTOR_CONFIG_ENV} must be a JSON object, not {raw!r}")
        extra |= more
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def engine_env(kv_cache_bytes: int) -> dict[str, str]:
    """A driver's environment: no KVSTORE_* settings, a CPU KV cache of at least
    ``kv_cache_bytes`` (vLLM sizes it in whole GiB), and the suite importable
    (``harness.child_env``: the checkout on PYTHONPATH for the top-level ``benchmarks``)."""
    env = child_env({k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")})
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_cache_bytes / (1 << 30))))
    return env


@contextlib.contextmanager
def scratch(suite: str) -> Iterator[Path]:
    """A directory for a suite's model, servers and engine logs: removed when the suite
    succeeds, kept (and named on stderr) when it fails."""
    work = Path(tempfile.mkdtemp(prefix=f"kvstore-{suite}-"))
    try:
        yield work
    except BaseException:
        print(f"[{suite}] engine logs kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)


class EngineProcess:
    """One driver process (``python -m DRIVER --spec FILE``): its log goes to a file, its
    protocol lines to a queue."""

    def __init__(
        self, name: str, driver: str, spec: dict[str, Any], work: Path, env: dict[str, str]
    ) -> None:
        self.name = name
        spec_path = work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = work / f"{name}.log"
        self.lines: list[str] = []  # every log line, for what the connector logs per prompt
        self.results: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", driver, "--spec", str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, cwd=child_cwd(), env=env,
            start_new_session=True,  # vLLM's engine core and worker join its process group
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()  # readable while the engine runs
                if line.startswith((MARK_READY, MARK_TTFT)):
                    mark, _, payload = line.partition(" ")
                    self.results.put((mark, json.loads(payload)))
                else:
                    self.lines.append(line)
        self.results.put(("eof", {}))

    def _next(self, want: str, timeout: float) -> dict[str, Any]:
        try:
            mark, payload = self.results.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"engine {self.name}: no answer in {timeout:.0f} s") from None
        if mark != want:
            raise RuntimeError(f"engine {self.name} exited (rc={self.proc.poll()}):\n{self.tail()}")
        return payload

    def wait_ready(self) -> None:
        self._next(MARK_READY, START_S)

    def request(self, cmd: dict[str, Any], settle_s: float = 0.0) -> dict[str, Any]:
        """Send one prompt command; its ``@@ttft`` payload, with ``log``: the lines the
        engine printed meanwhile (the connector's own load timings are among them).
        ``settle_s``: wait that long after the answer for lines still on their way (the
        worker process writes its log into the same pipe, after the answer at times)."""
        assert self.proc.stdin is not None
        first = len(self.lines)
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._next(MARK_TTFT, REQUEST_S)
        if settle_s:
            time.sleep(settle_s)
        out["log"] = self.lines[first:]
        return out

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        # The engine core and its worker outlive a driver that dies or hangs: end the group.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._reader.join(5)
