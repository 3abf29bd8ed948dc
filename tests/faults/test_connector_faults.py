"""The vLLM connector when its server is unreachable at start, stalled past the deadline, or
killed in the middle of a phase: every request completes with the same output.

tests/connectors/test_vllm_connector.py already covers a server killed between
phases and a corrupt record. This adds the other faults in ONE engine run (an
engine costs about a minute to build here), over eight phases of the same prompts:

1. the server is not running when the engine starts (and during the whole phase):
   everything is computed; these outputs are the reference for the other phases;
2. the server is started: the connector reconnects and stores;
3. the server is stopped with SIGSTOP (it accepts connections and never answers):
   lookups and loads run past their deadlines, everything is computed again;
4. SIGCONT: the connector loads what phase 2 stored (from L1: in the step);
5. the server is killed with SIGKILL 0.2 s after the phase starts;
6. restarted on its data (L1 empty, so hits load in the background) and stopped
   with SIGSTOP as soon as it has answered the phase's first lookup: the background
   load that lookup started waits for an answer that never comes, until its
   deadline (load_deadline_ms);
7. continued, restarted (L1 empty again), and killed after the first lookup;
8. started again: the background loads from disk succeed.

The engine's KV cache is 16 blocks under 128-token prefill steps and some requests
decode into a block more, so vLLM preempts requests throughout (resumed ones look up
and load again) while others load.
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

import kvstore
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

DEADLINE_MS = 500  # load_deadline_ms: shorter than timeout_ms, so a stalled load ends at it
RETRY_MS = 2000  # retry_after_ms: a stalled server is tried again this often
PAST_RETRY_S = RETRY_MS / 1000 + 0.5


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

    def after_first_lookup(sig: int) -> None:
        """Signal the server as soon as it has answered the phase's first lookup: the
        background load that lookup started is then on its way or about to be."""
        assert server.proc is not None
        with kvstore.Client(server.unix_url) as c:
            base, deadline = c.stats().lookups, time.monotonic() + 60
            while c.stats().lookups == base and time.monotonic() < deadline:
                time.sleep(0.002)
        server.proc.send_signal(sig)

    def restart() -> None:  # on the same data: L1 empty, everything on disk
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)
            server.stop(signal.SIGTERM)
        server.start()
        time.sleep(PAST_RETRY_S)  # past the connector's retry_after_ms

    def between(i: int) -> None:
        if i == 1:  # the engine ran phase 1 with nothing listening: start the server
            t0 = time.monotonic()
            server.start()
            events["start_s"] = time.monotonic() - t0
            time.sleep(PAST_RETRY_S)  # past the connector's retry_after_ms
        elif i == 2:
            server.pause()
        elif i == 3:
            server.resume()
            time.sleep(PAST_RETRY_S)
        elif i == 4:
            threading.Thread(target=kill_soon, daemon=True).start()
        elif i == 5:
            restart()
            threading.Thread(target=after_first_lookup, args=(signal.SIGSTOP,), daemon=True).start()
        elif i == 6:
            restart()
            threading.Thread(target=after_first_lookup, args=(signal.SIGKILL,), daemon=True).start()
        elif i == 7:
            restart()

    t0 = time.monotonic()
    info: list[dict[str, Any]] = []
    results = run_engine(
        work,
        "faults2",
        [PHASE_HIT] * 8,
        kv_config(
            server.unix_url, timeout_ms=1000, load_deadline_ms=DEADLINE_MS, retry_after_ms=RETRY_MS
        ),
        # 16 blocks of 128 tokens: three requests at a time, and A, D and two of the batch
        # need a block more while they decode 48 tokens, so vLLM preempts.
        llm={"max_num_batched_tokens": 128, "num_gpu_blocks_override": 16, "max_model_len": 1024},
        max_tokens=48,
        sync=work / "sync",
        between=between,
        phase_info=info,
    )
    seconds = time.monotonic() - t0
    p1 = results[0]
    mismatched = []
    for i, p in enumerate(results[1:], 2):
        try:
            assert_same(p, p1, f"phase {i}")
        except AssertionError as e:
            mismatched.append(str(e))
    cached = [sum(r["num_cached_tokens"] for r in p) for p in results]
    took = [round(p["seconds"], 1) for p in info]
    preempted = [int(p["metrics"].get("vllm:num_preemptions", 0)) for p in info]
    log = (work / "faults2.log").read_text(errors="replace")
    late = log.count("not done within load_deadline_ms")
    failed = [int(p["metrics"].get("vllm:kvstore_load_failed_blocks", 0)) for p in info]
    loader_gave_up = late + sum(
        "kvstore loader:" in line and "DeadlineExceeded" in line for line in log.splitlines()
    )
    background = log.count("in the background")
    record(
        "Connector",
        "server unreachable at start, stalled (SIGSTOP), killed mid-phase",
        "one vLLM engine, phases 1-5 of the same 10 prompts: server not running at engine "
        "start; started; SIGSTOP past the deadlines; SIGCONT; SIGKILL 0.2 s into the phase",
        faults=3,
        requests=5 * len(PHASE_HIT),
        wrong=len(mismatched),
        notes=f"tokens loaded per phase {cached[:5]}; phases finished when the kill came: "
        f"{events.get('phases_done_at_kill')}; engine run {seconds:.0f} s",
    )
    record(
        "Connector",
        "background loads stopped or killed mid-load, under preemption",
        "the same engine, phases 6-8: restarted (disk hits load in the background) and "
        "SIGSTOP after the first lookup; restarted and SIGKILL after the first lookup; "
        "restarted; 16-block KV cache",
        faults=2,
        requests=3 * len(PHASE_HIT),
        wrong=len(mismatched),
        notes=f"tokens loaded in phases 6-8 {cached[5:]}; seconds per phase {took}; "
        f"preemptions so far {preempted}; background load lines {background}; failed blocks "
        f"so far {failed}; loads ended by a deadline {loader_gave_up} (late {late}, "
        f"load_deadline_ms {DEADLINE_MS})",
    )
    assert not mismatched, mismatched
    assert cached[0] == 0, "nothing can load from a server that is not running"
    assert cached[2] == 0, "nothing can load from a stalled server"
    assert cached[3] > 0, "after SIGCONT the connector must load again"
    assert cached[7] > 0 and background, (
        f"after a restart hits on disk must load in the background: {cached}, log lines "
        f"{background}"
    )
    assert preempted and preempted[-1] > 0, f"vLLM never preempted a request: {preempted}"
    # Phase 6: a load the stalled server holds ends at its deadline as failed blocks,
    # recomputed. Since the scheduler's lookup lends what it finds (L2 chunks where the
    # client reads LMDB's file), a load whose chunks were lent before the SIGSTOP needs no
    # call to the server and is not held at all: which one happens races the signal (CI
    # saw both). Either way every output matches (above) and the run ends; the deadline
    # path alone: test_connector_loads.py, test_a_late_background_load_is_reported_at_
    # its_deadline_and_writes_nothing_after.
    held = failed[5] > failed[4]
    assert not held or loader_gave_up, (
        "the background load the stalled server held in phase 6 must end by its deadline "
        f"(its call's or load_deadline_ms) as failed blocks, recomputed: failed blocks by "
        f"phase {failed}, loader deadline lines {loader_gave_up}, late loads {late}"
    )
    # Phase 6: a server stalled mid-load costs each call at most its deadline, never a
    # hang: no slower than a server stalled from the start (phase 3), with room for noise.
    assert took[5] < 2 * max(took[0], took[2]) + 10, took
