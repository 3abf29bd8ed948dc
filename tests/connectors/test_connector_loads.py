"""The connector's load path without an engine (tests/connectors/halves.py), against a real
kvstore-server: what a step's loads cost in calls, that blocks go from the arena straight
into the cache verified, and what asynchronous loads do when they are late, preempted or
aborted.

Each prompt is first computed and stored from its own "source" blocks (KV the engine
computed), then loaded into zeroed "destination" blocks: a load is right when the
destination holds the source's bytes.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvstore.connectors import vllm_async, vllm_blocks, vllm_loads, vllm_scheduler
from kvstore.connectors.vllm_client import BreakerClient
from kvstore.connectors.vllm_config import ConnectorConfig
from kvstore.connectors.vllm_meta import KVStoreMeta

from kvstore.errors import ConfigError
from kvstore.sdk import scatter, shm
from kvstore.sdk.client import Client
from kvstore.testing.server import KVServer
from tests.connectors.halves import BS, Blocks, Engine, step_output

CHUNK = 256  # the server's chunk_tokens
DATA_PLANE = ("AcquireMany", "Acquire", "Get", "Release", "Lookup")


def prompt(i: int, n: int = 600) -> list[int]:
    return [(7919 * i + 31 * t) % 30000 + 10 for t in range(n)]


def stored(n: int) -> int:
    """Tokens of an n-token prompt that are stored: its whole blocks."""
    return n // BS * BS


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KVServer]:
    s = KVServer(tmp_path / "srv", memory="256MiB").start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        s.proc.send_signal(signal.SIGCONT)
    s.stop(signal.SIGKILL)


@pytest.fixture
def engine(server: KVServer) -> Iterator[Engine]:
    e = Engine(server.unix_url, blocks=1200, load_deadline_ms=400)
    yield e
    e.close()


class Layout:
    """Source and destination blocks of the test's prompts, disjoint in one cache."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // BS)
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def requests(server: KVServer) -> dict[str, int]:
    with Client(server.unix_url) as c:
        return dict(c.stats().extra.get("requests", {}))


def calls_since(server: KVServer, before: dict[str, int], settle_s: float = 1.0) -> dict[str, int]:
    """Data-plane calls the server finished since ``before`` (a Release sent without
    waiting may land a moment later)."""
    deadline = time.monotonic() + settle_s
    while True:
        now = requests(server)
        got = {m: now.get(m, 0) - before.get(m, 0) for m in DATA_PLANE}
        got["Stats"] = 0
        if got["Release"] or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def store(engine: Engine, prompts: list[list[int]], lay: Layout) -> list[list[int]]:
    """Compute and store each prompt from fresh source blocks; the sources."""
    srcs = [lay.take(len(p)) for p in prompts]
    got = engine.step(list(zip(prompts, srcs, strict=True)))
    assert all(a.told == 0 for a in got), "the prompts were stored already"
    return srcs


def held(server: KVServer, settle_s: float = 2.0) -> int:
    """Leases and L2 loans the server holds, once none are left or ``settle_s`` passed
    (a Release sent without waiting may land a moment later)."""
    deadline = time.monotonic() + settle_s
    while True:
        with Client(server.unix_url) as c:
            st = c.stats()
        n = st.tiers[0].detail["active_leases"] + st.tiers[1].detail.get("loans", 0)
        if not n or time.monotonic() > deadline:
            return int(n)
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["lent", "acquired", "too long to lend"])
@pytest.mark.parametrize("count", [4, 12])
def test_a_steps_loads_cost_a_constant_number_of_calls(
    count: int, how: str, engine: Engine, server: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``count`` requests of 3 chunks each load in one step: one Lookup each (the
    scheduler's), which lends the chunks it found; the worker reads through those
    leases with no call of its own and ends them all in one Release. Where the lookup
    lends nothing (``acquired``: a worker of another rank, say) one AcquireMany takes
    them all, as for a hit of more chunks than the lookup lends (``too long``: one
    chunk here). No Acquire, no Get, and the worker looks nothing up again. A regression
    to calls per chunk (or per request) makes the counts grow with ``count``; every
    lease ends."""
    lends = how == "lent"
    engine.scheduler._lends = how != "acquired"
    if how == "too long to lend":
        monkeypatch.setattr(vllm_scheduler, "_LEND_CHUNKS", 1)
    lay = Layout()
    prompts = [prompt(100 * count + i) for i in range(count)]
    srcs = store(engine, prompts, lay)
    dsts = [lay.take(len(p)) for p in prompts]
    before = requests(server)
    got = engine.step(list(zip(prompts, dsts, strict=True)))
    calls = calls_since(server, before)
    assert all(a.told == stored(600) and not a.background for a in got), [
        (a.told, a.background) for a in got
    ]
    assert all(not a.failed for a in got), "every block must load"
    for src, dst in zip(srcs, dsts, strict=True):
        k = stored(600) // BS
        assert engine.same(dst[:k], src[:k]), "a loaded block differs from the stored one"
    assert calls == {
        "AcquireMany": 0 if lends else 1,
        "Acquire": 0,
        "Get": 0,
        "Release": 1,
        "Lookup": count,
        "Stats": 0,
    }, f"{count} requests x 3 chunks loaded in one step cost {calls}"
    assert held(server) == 0, "a lease of the step's loads was never ended"


def test_leases_a_lookup_lent_end_when_no_load_takes_them(engine: Engine, server: KVServer) -> None:
    """The scheduler's lookup lends the chunks it found; each way a hit ends without a
    load ends its leases too, with no wait for lease_ms: the request went away before
    it was scheduled, vLLM allocated nothing external for it, vLLM's own cache already
    held the hit. Two requests of one step lending the same chunks: the worker reads
    through one lease per chunk and ends the other."""
    lay = Layout()
    prompts = [prompt(900 + i) for i in range(3)]
    store(engine, prompts, lay)
    assert held(server) == 0
    sched = engine.scheduler

    def req(i: int) -> Any:
        return SimpleNamespace(
            request_id=f"lend-{i}", prompt_token_ids=prompts[i % 3], num_tokens=600
        )

    n, _ = sched.get_num_new_matched_tokens(req(0), 0)
    assert n == stored(600) and held(server, 0) == 3, "the lookup lent the hit's chunks"
    sched.request_finished(req(0))
    assert held(server) == 0, "an aborted request's leases"
    sched.get_num_new_matched_tokens(req(1), 0)
    sched.update_state_after_alloc(req(1), Blocks([]), 0)
    sched.request_finished(req(1))
    assert held(server) == 0, "leases of a hit vLLM allocated nothing for"
    n, _ = sched.get_num_new_matched_tokens(req(2), stored(600))
    assert n == 0 and held(server) == 0, "leases of a hit vLLM's own cache holds"
    sched.request_finished(req(2))

    dsts = [lay.take(600) for _ in range(2)]
    got = engine.step([(prompts[0], dsts[0]), (prompts[0], dsts[1])])
    assert all(a.told == stored(600) and not a.failed for a in got), got
    assert engine.same(dsts[0][:4], dsts[1][:4])
    assert held(server) == 0, "the second request's leases on the same chunks"


def test_large_batches_are_copied_by_two_threads_into_the_same_places(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch past ``_SPLIT_BYTES`` is copied by the engine's thread and a helper, each
    chunk whole by one of them: every block lands where it belongs, verified."""
    monkeypatch.setattr(vllm_loads, "_SPLIT_BYTES", 0)
    lay = Layout()
    prompts = [prompt(40 + i) for i in range(3)]
    srcs = store(engine, prompts, lay)
    dsts = [lay.take(len(p)) for p in prompts]
    for d in dsts:
        engine.zero(d)
    helper = engine.worker.loads
    got = engine.step(list(zip(prompts, dsts, strict=True)))
    assert helper is not None and helper._pool is not None, "the helper thread never copied"
    k = stored(600) // BS
    assert all(a.told == stored(600) and not a.failed for a in got), [a.failed for a in got]
    for src, dst in zip(srcs, dsts, strict=True):
        assert engine.same(dst[:k], src[:k]), "a block copied by two threads landed wrong"


def test_blocks_go_from_the_arena_into_the_cache_without_a_host_buffer(
    engine: Engine, server: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L1 hits: no host buffer is allocated for a chunk; also for a request whose first
    blocks are in vLLM's own prefix cache (a load starting inside a chunk), whose
    earlier blocks must stay as they are."""
    lay = Layout()
    p = prompt(1)
    (src,) = store(engine, [p], lay)
    staged: list[int] = []
    real = vllm_blocks.BlockLayout.host_buffer

    def counted(self: Any, nbytes: int) -> Any:
        staged.append(nbytes)
        return real(self, nbytes)

    monkeypatch.setattr(vllm_blocks.BlockLayout, "host_buffer", counted)
    dst = lay.take(len(p))
    (a,) = engine.step([(p, dst)])
    k = stored(600) // BS
    assert a.told == stored(600) and not a.failed and engine.same(dst[:k], src[:k])
    assert not staged, f"loads from L1 staged {len(staged)} chunk(s) through host buffers"

    # vLLM already holds the first 5 blocks (a local prefix-cache hit inside chunk 0):
    # the load starts at block 5, so chunk 0's first 5 blocks go nowhere of their own.
    dst2 = lay.take(len(p))
    engine.zero(dst2)
    marker = dst2[:5]
    for view in engine.cache.values():
        view[marker] = 7
    (b,) = engine.step([(p, dst2)], computed=[5 * BS])
    assert b.told == stored(600) - 5 * BS and not b.failed, (b.told, b.failed)
    assert engine.same(dst2[5:k], src[5:k]), "the blocks after the local hit must load"
    assert all(bool((v[marker] == 7).all()) for v in engine.cache.values()), (
        "blocks vLLM already holds must not be written"
    )
    assert not staged, "a load starting inside a chunk must not stage either"


@pytest.mark.parametrize("by_layer", [True, False], ids=["by-layer", "before-forward"])
@pytest.mark.parametrize("reread", ["good", "fails"])
def test_a_payload_that_does_not_verify_is_read_again_or_a_load_error(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, reread: str, by_layer: bool
) -> None:
    """The bytes copied out of the arena are hashed as they land; a digest that is not the
    record's (a rogue writer, pages reused after a lease ran out) sends that chunk, and
    only it, to be read again with Get, where the server verifies it (and deletes a
    damaged copy). Copied before the forward pass, its bytes land if that read is good;
    copied layer by layer, the forward pass has used it already, so its blocks are
    reported either way (vLLM recomputes them and drops the step's token)."""
    assert engine.worker.loads is not None
    engine.worker.loads.by_layer = by_layer
    lay = Layout()
    p = prompt(2)
    src = store(engine, [p], lay)[0]
    calls: list[int] = []
    if by_layer:
        real_streams = scatter.accel.Streams

        class Tampered:  # the second chunk's stream ends in another digest
            def __init__(self, n: int) -> None:
                self.s = real_streams(n)

            def __len__(self) -> int:
                return len(self.s)

            def digest(self, i: int) -> int:
                calls.append(i)
                return int(self.s.digest(i)) ^ (i == 1)

        real_copy = scatter.accel.scatter_streams
        monkeypatch.setattr(scatter.accel, "Streams", Tampered)
        monkeypatch.setattr(scatter.accel, "scatter_streams", lambda st, *a: real_copy(st.s, *a))
    else:
        real = shm.accel.scatter_xxh3

        def tampered(*args: Any) -> int:
            calls.append(1)
            digest = real(*args)
            return digest ^ 1 if len(calls) == 2 else digest  # the second chunk's copy

        monkeypatch.setattr(shm.accel, "scatter_xxh3", tampered)
    gets: list[bytes] = []
    get_into = BreakerClient.get_into

    def counted(self: BreakerClient, key: bytes, *args: Any) -> Any:
        gets.append(key)
        if reread == "fails":
            return None  # the server found it damaged too: a miss
        return get_into(self, key, *args)

    monkeypatch.setattr(BreakerClient, "get_into", counted)
    dst = lay.take(len(p))
    (a,) = engine.step([(p, dst)])
    assert calls, "the verified copy was never used"
    assert len(gets) == 1, f"exactly the chunk that failed its check is read again: {gets}"
    if reread == "good" and not by_layer:
        assert not a.failed and engine.same(dst[:32], src[:32]), "the Get's bytes must land"
    else:
        assert a.failed == set(dst[16:32]), "exactly the second chunk's blocks must be reported"
        assert engine.same(dst[:16], src[:16]), "the first chunk must land"


class CopyLog:
    """ScatterBatch.copy made slow and recorded: when each layer started and landed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, slow_s: float, late: int = -1) -> None:
        self.landed: dict[int, float] = {}
        self.started: list[int] = []
        real = scatter.ScatterBatch.copy

        def copy(batch: scatter.ScatterBatch, part: int) -> None:
            self.started.append(part)
            time.sleep(slow_s * (20 if part == late else 1))
            real(batch, part)
            self.landed[part] = time.monotonic()

        monkeypatch.setattr(scatter.ScatterBatch, "copy", copy)


def test_a_tickets_fence_admits_copies_together_and_cancel_waits_for_them() -> None:
    """Two threads may copy chunks of one request at once; ``cancel`` returns only once
    both copies are over, and no copy starts after it."""
    ticket = vllm_async.Ticket(None, 0.0)  # type: ignore[arg-type]
    inside = threading.Barrier(3, timeout=10)
    go_on = threading.Event()

    def copy() -> None:
        with ticket.copying() as go:
            assert go
            inside.wait()
            go_on.wait(10)

    copies = [threading.Thread(target=copy) for _ in range(2)]
    for t in copies:
        t.start()
    inside.wait()  # both copies are inside the fence together
    cancel = threading.Thread(target=ticket.cancel)
    cancel.start()
    cancel.join(0.2)
    assert cancel.is_alive(), "cancel returned while copies were still writing"
    go_on.set()
    cancel.join(10)
    assert not cancel.is_alive(), "cancel did not return once the copies were over"
    with ticket.copying() as go:
        assert not go, "a copy started after cancel"
    for t in copies:
        t.join(10)


def test_a_load_in_the_step_lands_layer_by_layer_beside_the_forward_pass(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start_load_kv returns before the copy is done (the forward pass starts), each
    layer's wait returns only once that layer has landed, and what landed is right."""
    lay = Layout()
    ps = [prompt(60), prompt(61)]
    srcs = store(engine, ps, lay)
    dsts = [lay.take(len(p)) for p in ps]
    log = CopyLog(monkeypatch, 0.03)
    worker = engine.worker
    started: list[float] = []
    waits: list[tuple[str, float]] = []
    real_start, real_wait = worker.start_load_kv, worker.wait_for_layer_load

    def start(meta: Any) -> None:
        real_start(meta)
        started.append(time.monotonic())

    def wait(name: str) -> None:
        real_wait(name)
        waits.append((name, time.monotonic()))

    monkeypatch.setattr(worker, "start_load_kv", start)
    monkeypatch.setattr(worker, "wait_for_layer_load", wait)
    got = engine.step(list(zip(ps, dsts, strict=True)))
    assert all(a.told == stored(600) and not a.failed for a in got), got
    assert worker.layout is not None and len(log.landed) == worker.layout.layers
    assert started[0] < log.landed[0], "start_load_kv waited for the copy"
    for k, (name, t) in enumerate(waits[: worker.layout.layers]):
        assert name == worker.layout.names[k]
        assert log.landed[k] <= t, f"the wait for {name} returned before its layer landed"
    for p, src, dst in zip(ps, srcs, dsts, strict=True):
        k = stored(len(p)) // BS
        assert engine.same(dst[:k], src[:k]), "the layers did not land right"


def test_a_load_below_load_by_layer_bytes_is_copied_before_the_forward_pass(
    server: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer by layer only from ``load_by_layer_bytes`` on: a smaller load is copied and
    verified before start_load_kv returns. The bytes land either way."""
    made: list[int] = []
    real = vllm_loads.LayerCopy

    def layer_copy(*args: Any) -> Any:
        made.append(1)
        return real(*args)

    monkeypatch.setattr(vllm_loads, "LayerCopy", layer_copy)
    for limit, layered in (("1GiB", False), ("64KiB", True)):
        e = Engine(server.unix_url, blocks=1200, load_by_layer_bytes=limit)
        try:
            lay = Layout()
            p = prompt(90 + layered)
            (src,) = store(e, [p], lay)
            made.clear()
            dst = lay.take(len(p))
            (a,) = e.step([(p, dst)])
            k = stored(600) // BS
            assert a.told == stored(600) and not a.failed and e.same(dst[:k], src[:k])
            assert bool(made) == layered, f"load_by_layer_bytes={limit}: layer copies {made}"
        finally:
            e.close()
    with pytest.raises(ConfigError, match="load_by_layer_bytes"):
        ConnectorConfig(load_by_layer_bytes="lots")


def test_a_forward_pass_that_does_not_wait_fails_the_load_and_turns_layers_off(
    engine: Engine,
) -> None:
    """An attention that never calls wait_for_layer_load may have read a layer still
    landing: the step's loaded blocks are reported (vLLM recomputes them, dropping the
    token), and later loads copy every layer before the forward pass."""
    assert engine.worker.loads is not None and engine.worker.loads.by_layer
    lay = Layout()
    p, q = prompt(70), prompt(71)
    _, src_q = store(engine, [p, q], lay)
    engine.forward_waits = False
    dst = lay.take(len(p))
    (a,) = engine.step([(p, dst)])
    assert a.told == stored(600) and a.failed == set(dst[: stored(600) // BS]), a.failed
    assert not engine.worker.loads.by_layer, "layer by layer loading must turn off"
    dst = lay.take(len(q))
    (b,) = engine.step([(q, dst)])
    assert b.told == stored(600) and not b.failed
    assert engine.same(dst[: stored(600) // BS], src_q[: stored(600) // BS])


@pytest.mark.parametrize("which", ["second", "last"])
def test_a_layer_later_than_the_timeout_fails_the_load_without_hanging(
    server: KVServer, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """A layer that does not land within timeout_ms: the forward pass goes on, the step's
    loaded blocks are reported, the layers after it are not copied, and the step ends
    once the layer being copied has landed (nothing is written after it). The last
    layer late too: every layer then lands, but after the forward pass read it."""
    e = Engine(server.unix_url, blocks=1200, timeout_ms=300)
    try:
        lay = Layout()
        p = prompt(80)
        store(e, [p], lay)
        late = 1 if which == "second" else len(e.worker.layout.names) - 1
        log = CopyLog(monkeypatch, 0.05, late=late)  # that layer takes 1 s
        dst = lay.take(len(p))
        t0 = time.monotonic()
        (a,) = e.step([(p, dst)])
        took = time.monotonic() - t0
        assert a.failed == set(dst[: stored(600) // BS]), "a late layer must fail the load"
        assert log.started == list(range(late + 1)), (
            f"layers after the late one were copied: {log.started}"
        )
        assert took < 5, f"the step took {took:.1f} s"
    finally:
        e.close()


def test_hits_below_l1_load_in_the_background(engine: Engine, server: KVServer) -> None:
    """After a restart the chunks are on disk only: the request is told load_async, waits
    while the worker loads it (through the loans the lookup made: no AcquireMany), and
    loads right, each chunk copied from where it lies in LMDB's file (lent: the lookup
    neither promotes it into L1 first nor prefetches it there)."""
    lay = Layout()
    ps = [prompt(3), prompt(4)]
    srcs = store(engine, ps, lay)
    disk_only(server, engine)
    before = requests(server)
    dsts = [lay.take(600) for _ in ps]
    got = engine.step(list(zip(ps, dsts, strict=True)), wait_s=20)
    calls = calls_since(server, before)
    k = stored(600) // BS
    for a, src, dst in zip(got, srcs, dsts, strict=True):
        assert a.background, "a hit on disk must load in the background"
        assert a.told == stored(600) and not a.failed, (a.told, a.failed, engine.breakers())
        assert engine.same(dst[:k], src[:k]), "a background load put other bytes"
    assert calls["AcquireMany"] == 0 and calls["Get"] == 0 and calls["Acquire"] == 0, calls
    with Client(server.unix_url) as c:
        l1, l2 = c.stats().tiers[:2]
    chunks = len(ps) * -(-stored(600) // CHUNK)
    assert l2.detail["lent"] == chunks, f"L2 lent {l2.detail['lent']} of {chunks} chunks"
    assert l1.used_bytes == 0, "a chunk was promoted into L1 on its way to the cache"


def test_a_background_load_yields_to_requests_computing_beside_it(
    engine: Engine, server: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While other requests compute (the step's total_num_scheduled_tokens), a background
    load sleeps after each chunk, copying ``background_load_share`` of the time (a third
    by default: twice a chunk's copy asleep), on the loader thread alone; with nothing
    else computing it never sleeps, and a second thread copies beside the loader (the
    compute cores are idle). The bytes land either way."""
    lay = Layout()
    ps = [prompt(5), prompt(6)]
    srcs = store(engine, ps, lay)
    disk_only(server, engine)
    assert engine.worker.background is not None
    loads = engine.worker.background.loads
    slept: list[float] = []
    loads._sleep = slept.append
    monkeypatch.setattr(vllm_loads, "_SPLIT_BYTES", 1)  # these test chunks are small
    copiers: set[str] = set()
    copy_all = vllm_loads.Loads._copy_all

    def recorded(self: vllm_loads.Loads, *args: Any) -> None:
        copiers.add(threading.current_thread().name)
        copy_all(self, *args)

    monkeypatch.setattr(vllm_loads.Loads, "_copy_all", recorded)
    k = stored(600) // BS
    chunks = -(-stored(600) // CHUNK)
    for i, decoding in ((0, 0), (1, 4)):
        engine.decoding = decoding
        dst = lay.take(600)
        (got,) = engine.step([(ps[i], dst)], wait_s=20)
        assert got.background and not got.failed, (got, engine.breakers())
        assert engine.same(dst[:k], srcs[i][:k]), "a background load put other bytes"
        if decoding:
            assert len(slept) == chunks and all(s > 0 for s in slept), (
                f"beside {decoding} decodes the load slept {slept} after its {chunks} chunks"
            )
            assert copiers == {"kvstore-loader"}, f"beside decodes, copied by {copiers}"
        else:
            assert slept == [], f"alone, the load slept {slept}"
            assert len(copiers) == 2, f"alone, the load was copied by {copiers} only"
        copiers.clear()


class Stall:
    """Makes the loader's next call for its leases (taking those the lookup lent, or an
    AcquireMany) wait ``seconds`` first (a busy server, a stalled host)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
        self.seconds, self.entered, self.left = seconds, threading.Event(), threading.Event()
        for name in ("adopt", "acquire_many"):
            monkeypatch.setattr(Client, name, self._slow(getattr(Client, name)))

    def _slow(self, real: Any) -> Any:
        def slow(client: Client, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == "kvstore-loader" and not self.entered.is_set():
                self.entered.set()
                time.sleep(self.seconds)
                try:
                    return real(client, *args, **kwargs)
                finally:
                    self.left.set()
            return real(client, *args, **kwargs)

        return slow


def background_request(engine: Engine, p: list[int], ids: list[int]) -> Any:
    """Admit one request that loads in the background; its request object."""
    req = type("R", (), {"request_id": f"bg-{ids[0]}", "prompt_token_ids": p, "num_tokens": len(p)})
    n, background = engine.scheduler.get_num_new_matched_tokens(req, 0)
    assert background and n == stored(len(p)), (n, background)
    engine.scheduler.update_state_after_alloc(req, Blocks(ids), n)
    engine._run(step_output([]))
    return req


def loader_connected(engine: Engine) -> Any:
    """The background loader's SDK client, once its start-up connect is done (that
    connect runs on the loader thread, after the engine is built)."""
    assert engine.worker.background is not None
    loader = engine.worker.background.loads.client
    deadline = time.monotonic() + 10
    while (c := loader._client) is None or c.arena is None:
        assert time.monotonic() < deadline, "the loader did not connect when it started"
        time.sleep(0.01)
    assert c.session_up.wait(5), "the loader's Session never came up"
    return c


def disk_only(server: KVServer, engine: Engine) -> None:
    """Restart the server: what it held in L1 is now only on disk. The loader connects
    first: a restart inside its start-up connect would open its breaker for
    ``retry_after_ms`` (5 s) and the load would compute instead (a CI run saw it)."""
    loader_connected(engine)
    server.stop(signal.SIGTERM)
    server.start()
    time.sleep(0.3)


def _active_leases(server: KVServer) -> int:
    with Client(server.unix_url) as c:
        return int(c.stats().extra["active_leases"])


def test_the_loader_is_connected_before_its_first_load(server: KVServer) -> None:
    """The loader thread connects, maps the server's arena and starts its Session as it
    starts: its first background load makes no Info call and pays no mapping or thread
    start (10-18 ms of a first 4k-token load in the loads benchmark)."""
    engine = Engine(server.unix_url, blocks=400, load_mode="async")
    try:
        c = loader_connected(engine)
        info, arena, session = c._info, c.arena, c._session
        lay = Layout()
        p = prompt(12)
        srcs = store(engine, [p], lay)
        dst = lay.take(len(p))
        (got,) = engine.step([(p, dst)], wait_s=20)
        assert got.background and got.told == stored(600) and not got.failed, got
        k = stored(600) // BS
        assert engine.same(dst[:k], srcs[0][:k]), "the background load put other bytes"
        assert engine.worker.background.loads.client._client is c, "the loader connected again"
        assert c._info is info, "the first background load asked the server's Info"
        assert c.arena is arena and c._session is session, "the load set up its plane anew"
        # Its leases end after the report, in a Release nobody waits for.
        deadline = time.monotonic() + 5
        while (held := _active_leases(server)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert held == 0, f"{held} leases still held after the background load"
    finally:
        engine.close()


def test_a_loader_that_never_loads_does_not_connect(server: KVServer) -> None:
    """With load_mode sync (and no hybrid model) nothing loads in the background: the
    loader's client takes no connection, arena mapping or Session of the server."""
    engine = Engine(server.unix_url, blocks=400, load_mode="sync")
    try:
        assert engine.worker.background is not None
        time.sleep(0.5)  # the loader thread has long started
        assert engine.worker.background.loads.client._client is None, "the loader connected"
    finally:
        engine.close()


def test_a_late_background_load_is_reported_at_its_deadline_and_writes_nothing_after(
    engine: Engine, server: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    lay = Layout()
    p = prompt(5)
    store(engine, [p], lay)
    disk_only(server, engine)
    stall = Stall(monkeypatch, 1.5)
    dst = lay.take(len(p))
    engine.zero(dst)
    t0 = time.monotonic()
    req = background_request(engine, p, dst)
    assert stall.entered.wait(5), "the loader never asked the server"
    reported: set[str] = set()
    while not reported and time.monotonic() - t0 < 5:
        reported, failed = engine._run(step_output([]))
        time.sleep(0.01)
    waited = time.monotonic() - t0
    assert reported == {req.request_id}, "a late load must be reported, not waited for"
    assert waited < 0.4 + 0.5, f"reported {waited:.2f} s after the start, deadline 0.4 s"
    assert failed == set(dst[: stored(600) // BS]), "every block to load must be a load error"
    for view in engine.cache.values():  # vLLM hands the blocks to whoever computes them
        view[dst] = 3
    assert stall.left.wait(5)
    time.sleep(0.2)
    assert all(bool((v[dst] == 3).all()) for v in engine.cache.values()), (
        "the load wrote into the blocks after it was given up"
    )
    _, work = engine.stats()
    assert work.get("load_late_requests") == 1, work


def test_a_step_that_computes_nothing_waits_a_moment_for_a_background_load(
    server: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a background load runs and nothing else computes, each step waits up to
    IDLE_WAIT_S for it (vLLM would run ~1,000 steps a second, each holding the GIL the
    loader needs), and the step after it lands reports it. A step beside decodes never
    waits."""
    # A deadline well past the stall: the fixture's 400 ms left a load on a busy host
    # (after the stall's 300 ms, the first calls to the restarted server) late at times.
    engine = Engine(server.unix_url, blocks=1200, load_deadline_ms=3000)
    try:
        _idle_steps_wait(engine, server, monkeypatch)
    finally:
        engine.close()


def _idle_steps_wait(engine: Engine, server: KVServer, monkeypatch: pytest.MonkeyPatch) -> None:
    lay = Layout()
    ps = [prompt(8), prompt(9)]
    store(engine, ps, lay)
    disk_only(server, engine)
    idles: list[float] = []
    idle = vllm_async.AsyncLoads.idle

    def timed(self: vllm_async.AsyncLoads) -> None:
        t = time.monotonic()
        idle(self)
        idles.append(time.monotonic() - t)

    monkeypatch.setattr(vllm_async.AsyncLoads, "idle", timed)
    for decoding in (0, 4):
        engine.decoding = decoding
        stall = Stall(monkeypatch, 0.3)
        dst = lay.take(600)
        req = background_request(engine, ps[decoding // 4], dst)
        assert stall.entered.wait(5), "the loader never asked the server"
        idles.clear()
        steps, t0 = 0, time.monotonic()
        reported: set[str] = set()
        while not reported and time.monotonic() - t0 < 5:
            reported, failed = engine._run(step_output([]))
            steps += 1
        took = time.monotonic() - t0
        assert reported == {req.request_id} and not failed, (reported, failed)
        assert stall.left.is_set() and took < 0.3 + 1.0, f"reported {took:.2f} s after"
        if decoding:
            assert idles == [], f"beside decodes {len(idles)} of {steps} steps waited"
        else:
            assert len(idles) == steps, f"{len(idles)} of {steps} idle steps waited"
            # Each but the last waited its IDLE_WAIT_S (the load landed in the last).
            assert steps <= took / vllm_async.IDLE_WAIT_S + 2, f"{steps} steps in {took:.2f} s"
            assert sorted(idles)[len(idles) // 2] >= vllm_async.IDLE_WAIT_S * 0.9, idles
    engine.decoding = 0


@pytest.mark.parametrize("how", ["preempted", "aborted"])
def test_a_preempted_or_aborted_request_stops_its_background_load(
    how: str, engine: Engine, server: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Preempted: the blocks are freed at once, vLLM forgets the load (it is not
    reported). Aborted: vLLM keeps the blocks until the load is reported, which it is in
    the next step. Either way nothing lands in the blocks afterwards."""
    lay = Layout()
    p = prompt(6 if how == "preempted" else 7)
    store(engine, [p], lay)
    disk_only(server, engine)
    stall = Stall(monkeypatch, 1.0)
    dst = lay.take(len(p))
    req = background_request(engine, p, dst)
    assert stall.entered.wait(5), "the loader never asked the server"
    out = step_output([], preempted={req.request_id} if how == "preempted" else None)
    if how == "aborted":
        out.finished_req_ids = {req.request_id}
    reported, failed = engine._run(out)
    if how == "preempted":
        assert not reported, "vLLM does not expect a preempted request's load to be reported"
    else:
        assert reported == {req.request_id}, reported
        assert failed == set(dst[: stored(600) // BS]), failed
    for view in engine.cache.values():
        view[dst] = 5
    assert stall.left.wait(5)
    time.sleep(0.2)
    for _ in range(3):
        again, _ = engine._run(step_output([]))
        assert not again, f"the {how} request was reported again"
    assert all(bool((v[dst] == 5).all()) for v in engine.cache.values()), (
        f"the load of a {how} request wrote into its blocks afterwards"
    )
    assert held(server) == 0, f"a lease of the {how} request's load was never ended"


def test_a_load_given_up_before_it_started_ends_the_leases_lent_for_it(
    engine: Engine, server: KVServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's load stalls in the loader (past its deadline); B's waits behind it and is
    preempted before the loader reaches it: the leases B's lookup lent end then, not
    after lease_ms, and those of A's late load once it is given up."""
    lay = Layout()
    pa, pb = prompt(8), prompt(9)
    store(engine, [pa, pb], lay)
    disk_only(server, engine)
    stall = Stall(monkeypatch, 1.0)
    da, db = lay.take(600), lay.take(600)
    a = background_request(engine, pa, da)
    assert stall.entered.wait(5), "the loader never asked the server"
    b = background_request(engine, pb, db)
    engine._run(step_output([], preempted={b.request_id}))
    assert stall.left.wait(5)
    deadline = time.monotonic() + 5
    reported: set[str] = set()
    while a.request_id not in reported:
        assert time.monotonic() < deadline, "A's load was never reported"
        reported |= engine._run(step_output([]))[0]
        time.sleep(0.01)
    assert b.request_id not in reported, "a preempted request's load was reported"
    assert held(server) == 0, "the leases lent for B's load were not ended"


def test_load_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="load_mode='later': allowed auto, sync, async"):
        ConnectorConfig(load_mode="later")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="load_deadline_ms must be > 0"):
        ConnectorConfig(load_deadline_ms=0)
    assert ConnectorConfig.parse({"load_mode": "async", "load_deadline_ms": "250"}) == (
        ConnectorConfig(load_mode="async", load_deadline_ms=250)
    )
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ConfigError, match=r"background_load_share=.*> 0 and <= 1"):
            ConnectorConfig(background_load_share=bad)
    assert ConnectorConfig.parse({"background_load_share": "0.5"}).background_load_share == 0.5
    assert isinstance(KVStoreMeta().preempted, list)
