"""The vLLM connector when its server is unreachable at start, stalled past the deadline, or
killed in the middle of a phase: every request completes with the same output.

tests/connectors/test_vllm_connector.py already covers a server killed between
phases and a corrupt record. This adds the other faults in ONE engine run (an
engine costs about a minute to build here), over five phases of the same prompts:

1. the server is not running when the engine starts (and during the whole phase):
   everything is computed; these outputs are the reference for the other phases;
2. the server is started: the connector reconnects and stores;
3. the server is stopped with SIGSTOP (it accepts connections and never answers):
   lookups and loads run past their deadlines, everything is computed again;
4. SIGCONT: the connector loads what phase 2 stored;
5. the server is killed with SIGKILL 0.2 s after the phase starts.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvstore.testing.server import KVServer
from kvstore.testing.tinymodel import make_tiny_llama
from tests.connectors.test_vllm_connector import (
    ENGINE_TIMEOUT,
    PHASE_HIT,
    assert_same,
    kv_config,
    run_engine,
)

pytestmark = pytest.mark.timeout(ENGINE_TIMEOUT)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    make_tiny_llama(tmp_path / "model")
    return tmp_path


@pytest.fixture
def server(work: Path) -> Iterator[KVServer]:
    s = KVServer(work / "srv", memory="256MiB")  # built, not started: unreachable at first
    yield s
    if s.proc is not None:
        s.proc.send_signal(signal.SIGCONT)
        s.stop(signal.SIGKILL)


def test_unreachable_stalled_and_killed_server(
    work: Path, server: KVServer, record: Callable[..., Any]
) -> None:
    out_file = work / "faults2.out.json"
    events: dict[str, Any] = {}

    def phases_done() -> int:
        try:
            return len(json.loads(out_file.read_text())["phases"])
        except (OSError, ValueError, KeyError):
            return 0

    def kill_soon() -> None:
        time.sleep(0.2)  # lookups and loads of the phase are under way
        events["phases_done_at_kill"] = phases_done()
        server.stop(signal.SIGKILL)

    def between(i: int) -> None:
        if i == 1:  # the engine ran phase 1 with nothing listening: start the server
            t0 = time.monotonic()
            server.start()
            events["start_s"] = time.monotonic() - t0
            time.sleep(1.0)  # past the connector's retry_after_ms
        elif i == 2:
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)
        elif i == 3:
            assert server.proc is not None
            server.proc.send_signal(signal.SIGCONT)
            time.sleep(1.0)
        elif i == 4:
            threading.Thread(target=kill_soon, daemon=True).start()

    t0 = time.monotonic()
    results = run_engine(
        work,
        "faults2",
        [PHASE_HIT] * 5,
        kv_config(server.unix_url, timeout_ms=1000),
        sync=work / "sync",
        between=between,
    )
    seconds = time.monotonic() - t0
    p1, p2, p3, p4, p5 = results
    mismatched = []
    for i, p in enumerate((p2, p3, p4, p5), 2):
        try:
            assert_same(p, p1, f"phase {i}")
        except AssertionError as e:
            mismatched.append(str(e))
    cached = [sum(r["num_cached_tokens"] for r in p) for p in results]
    record(
        "Connector",
        "server unreachable at start, stalled (SIGSTOP), killed mid-phase",
        "one vLLM engine, 5 phases of the same 10 prompts: server not running at engine "
        "start; started; SIGSTOP past the deadlines; SIGCONT; SIGKILL 0.2 s into the phase",
        faults=3,
        requests=5 * len(PHASE_HIT),
        wrong=len(mismatched),
        notes=f"tokens loaded per phase {cached}; phases finished when the kill came: "
        f"{events.get('phases_done_at_kill')}; engine run {seconds:.0f} s",
    )
    assert not mismatched, mismatched
    assert cached[0] == 0, "nothing can load from a server that is not running"
    assert cached[2] == 0, "nothing can load from a stalled server"
    assert cached[3] > 0, "after SIGCONT the connector must load again"
