"""Asynchronous loads: a worker thread loads the hits the scheduler sent off with
``load_async=True`` while the engine runs the other requests, and the engine thread
reports each one through ``get_finished`` once it is done, failed or late.

Every load has a deadline (``load_deadline_ms``, from the step that starts it). A load
past it, or of a request that finished meanwhile (aborted), is given up: its ticket is
cancelled (``Ticket.cancel`` returns once no copy into its blocks is under way, and
none starts after), the blocks not loaded yet are reported as load errors, and the
request is reported as finished receiving, so vLLM recomputes what is missing and
never waits longer than the deadline. A preempted request's ticket is cancelled the
same way, without a report: its blocks are already freed and vLLM forgets the load.

The thread has its own client (a failure there closes only that client, never the
one the engine thread loads with) and runs one batch (one step's asynchronous loads:
one AcquireMany, one Release) at a time.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

from kvstore.clock import Clock, monotonic

from .vllm_cpus import move_here
from .vllm_loads import Loads, SpecOutcome
from .vllm_meta import LoadSpec

log = init_logger("vllm.kvstore.connector")

# A step of an engine with nothing to compute but requests waiting for their loads is
# over at once, and vLLM runs the next: about a thousand steps a second of Python, each
# holding the GIL the loader takes back between its copies (get_finished was called
# once a millisecond through loads of 5-40 ms in the loads benchmark). Such a step waits
# this long for a load to land instead, the GIL let go: a new request waits as much at
# most, and a load that lands ends the wait.
IDLE_WAIT_S = 0.002


class Ticket:
    """One request's asynchronous load: its spec, its deadline, and the fence between the
    thread that copies into its blocks and the engine thread that gives up on it."""

    def __init__(self, spec: LoadSpec, deadline: float) -> None:
        self.spec = spec
        self.deadline = deadline  # on the worker's clock
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)  # notified when no copy runs
        self._copies = 0  # chunk copies into its blocks under way (two threads may copy)
        self.cancelled = False
        self.done = False
        self.outcome = SpecOutcome()
        self.loaded: set[int] = set()  # blocks already written and verified
        self.events: list[Any] = []  # CUDA: transfers queued into its blocks

    @contextlib.contextmanager
    def copying(self) -> Iterator[bool]:
        """Held while one chunk is copied into the request's blocks: False once cancelled.
        Copies of several chunks may run at once (the copying threads of one batch)."""
        with self.lock:
            go = not self.cancelled
            self._copies += go
        try:
            yield go
        finally:
            if go:
                with self.lock:
                    self._copies -= 1
                    if not self._copies:
                        self._idle.notify_all()

    def cancel(self) -> None:
        """Stop writing into the request's blocks; returns once no copy into them is under
        way (on CUDA, once the transfers already queued have landed)."""
        with self.lock:
            self.cancelled = True
            self._idle.wait_for(lambda: not self._copies)
            events, self.events = self.events, []
        for event in events:
            event.synchronize()


@dataclass
class Finished:
    """What ``AsyncLoads.finished`` reports for one step."""

    recving: set[str] = field(default_factory=set)  # requests whose loads are over
    failed: set[int] = field(default_factory=set)  # blocks they did not load
    failed_reqs: set[str] = field(default_factory=set)  # requests with a block not loaded
    loaded_tokens: int = 0
    late: int = 0  # loads given up at their deadline
    seconds: float = 0.0  # time the finished batches took on the loader thread
    batches: list[tuple[int, int, int, float]] = field(default_factory=list)


class AsyncLoads:
    """The asynchronous loads of one worker: ``submit`` a step's specs, ``finished`` once a
    step, ``preempted`` and ``close`` fence what is still running."""

    def __init__(
        self,
        loads: Loads,
        deadline_s: float,
        *,
        clock: Clock = monotonic,
        cpus: frozenset[int] | None = None,
        connect: bool = False,
    ) -> None:
        """``connect``: the loader's client connects as the thread starts (where the
        scheduler may send loads to the background), not in the first load."""
        self.loads = loads
        self._connect = connect
        self.cpus = cpus  # where the loader thread runs (vllm_cpus); None: where it starts
        self.deadline_s = deadline_s
        self._clock = clock
        self._tickets: dict[str, Ticket] = {}  # engine thread only
        self._batches: queue.SimpleQueue[list[Ticket] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: list[tuple[list[Ticket], float]] = []  # batches finished, with seconds
        self._landed = threading.Event()  # set as a batch finishes (``idle``)
        self._thread = threading.Thread(target=self._loop, name="kvstore-loader", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._tickets)

    def submit(self, specs: Sequence[LoadSpec]) -> None:
        """Start loading a step's asynchronous specs (engine thread; never blocks)."""
        until = self._clock() + self.deadline_s
        batch = []
        for spec in specs:
            old = self._tickets.pop(spec.req_id, None)
            if old is not None:  # a new load of the same request: the old one is void
                old.cancel()
            ticket = self._tickets[spec.req_id] = Ticket(spec, until)
            batch.append(ticket)
        if batch:
            self._batches.put(batch)

    def _loop(self) -> None:
        move_here(self.cpus)
        # Connected and the data plane set up before the first load, not during it: the
        # server's Info, the arena's mapping and the Session's thread took 10-18 ms of
        # the first background load in the loads benchmark. A server out of reach now is
        # the breaker's to retry, as at any load (BreakerClient reports it).
        if self._connect:
            try:
                self.loads.client.shm_active()
            except Exception as e:  # the data plane's set-up failed: reported, not fatal
                self.loads.client.failed("connect", e)
        while (batch := self._batches.get()) is not None:
            live = [t for t in batch if not t.cancelled]
            # The leases the lookup lent for loads given up before they started
            self.loads.let_go(
                list(self.loads.lent([t.spec for t in batch if t.cancelled]).values())
            )
            t0 = time.perf_counter()
            if live:
                # The tickets' deadline on the real clock: no call waits past it.
                left = min(t.deadline for t in live) - self._clock()
                outs = self.loads.load(
                    [t.spec for t in live], live, deadline=time.monotonic() + left
                )
                for t, out in zip(live, outs, strict=True):
                    with t.lock:
                        t.outcome = out
            seconds = time.perf_counter() - t0
            with self._lock:
                for t in batch:
                    t.done = True
                self._done.append((batch, seconds))
            self._landed.set()
            # The leases end after the report: sending the Release took 0.2-0.8 ms of a
            # 4k load's 4-6 ms in the loads benchmark (the GIL, taken back from the
            # engine thread), and the bytes were verified as they were copied.
            try:
                self.loads.release_done()
            except Exception as e:  # a bug (or a CUDA event's query): the thread goes on
                self.loads.client.failed("release", e)

    def idle(self) -> None:
        """A step that computes nothing, with loads under way: wait until one lands, up to
        IDLE_WAIT_S and never past a load's deadline (engine thread)."""
        if not self._tickets:
            return
        self._landed.clear()
        with self._lock:
            if self._done:  # landed already: finished() reports it now
                return
        left = min(IDLE_WAIT_S, min(t.deadline for t in self._tickets.values()) - self._clock())
        if left > 0:
            self._landed.wait(left)

    def finished(self, finished_req_ids: Iterable[str] = ()) -> Finished:
        """The loads that are over since the last call: done, past their deadline, or of
        requests that finished (engine thread, once a step)."""
        out = Finished()
        with self._lock:
            done, self._done = self._done, []
        for batch, seconds in done:
            live = [t for t in batch if not t.cancelled]
            out.seconds += seconds
            if live:
                tokens = sum(t.outcome.loaded_tokens for t in live)
                asked = sum(t.spec.end - t.spec.start for t in live)
                out.batches.append((tokens, asked, len(live), seconds))
        now = self._clock()
        gone = set(finished_req_ids)
        for rid, t in list(self._tickets.items()):
            if t.done and not t.cancelled:
                missing = t.outcome.failed
                out.loaded_tokens += t.outcome.loaded_tokens
            elif now >= t.deadline or rid in gone:
                t.cancel()  # nothing more lands in its blocks once this returns
                missing = set(t.spec.block_ids) - t.loaded
                out.late += rid not in gone
            else:
                continue
            out.failed |= missing
            if missing:
                out.failed_reqs.add(rid)
            del self._tickets[rid]
            out.recving.add(rid)
        return out

    def preempted(self, req_ids: Iterable[str]) -> int:
        """Stop the loads of preempted requests (their blocks are freed); how many ran."""
        n = 0
        for rid in req_ids:
            t = self._tickets.pop(rid, None)
            if t is not None:
                t.cancel()
                n += 1
        return n

    def close(self, timeout: float) -> None:
        for t in self._tickets.values():
            t.cancel()
        self._tickets.clear()
        self._batches.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kvstore: the loader thread did not stop within %.1f s", timeout)
