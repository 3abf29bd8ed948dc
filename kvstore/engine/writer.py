"""The store's background work: write-down (chunks moved or copied to the tiers below)
and prefetch (chunks promoted into L1 ahead of the reads that want them).

Two kinds of job: *copy* (write-through: the chunk stays where it is and a copy
goes down; the bytes are read from the source tier when the job runs) and
*move* (eviction: the tier is about to reuse the space, so the job carries the
bytes, and until it runs the store serves reads of that chunk from here).

Lock order, to stay deadlock-free: a tier's lock may be held when the store
lock is taken (eviction callbacks), never the reverse, and nobody waits for
this thread while holding a tier lock: ``submit_move`` never blocks; past the
byte budget it runs the write in the caller's thread instead.

``Prefetcher`` runs promotions on a few threads of its own: a prefetch is a hint
(the read that follows does the work if it was not done), so it never blocks the
caller, is deduplicated, and is bounded by the bytes queued or running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import KVStoreError
from kvstore.keys import ChunkKey
from kvstore.records import RecordHeader

log = logging.getLogger("kvstore.engine.writer")


@dataclass
class Job:
    key: ChunkKey
    targets: tuple[int, ...]  # tier levels to write to, top-down
    header: RecordHeader | None = None  # set for moves (the bytes travel with the job)
    blob: bytes | None = None

    @property
    def nbytes(self) -> int:
        return len(self.blob) if self.blob is not None else 0


Runner = Callable[[Job], None]


class WriteDown:
    """The write-down thread and its queue.

    Write-downs make way for writers: while the store serves reserves and commits (a
    client's save in flight: ``writing()`` marks each), a job waits for a quiet moment
    of ``quiet_s`` before it starts, at most ``max_defer_s``, so a save does not share
    the server's GIL and cores with the copy of the chunks saved just before it (the
    copy and LMDB's put take as long as the save itself). Past ``backlog`` queued jobs
    nothing waits: a writer that never pauses gets the write-down at full speed.
    """

    def __init__(
        self,
        run: Runner,
        budget_bytes: int,
        *,
        quiet_s: float = 0.002,
        max_defer_s: float = 0.02,
        backlog: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run = run
        self._budget = budget_bytes
        self._quiet_s, self._max_defer_s, self._backlog = quiet_s, max_defer_s, backlog
        self._clock = clock
        self._writing_at = -1e18  # when a reserve or commit was last served
        self.deferred = 0  # jobs that waited for a quiet moment
        self._queue: deque[Job] = deque()
        self._moves: dict[ChunkKey, Job] = {}  # chunks whose only copy is in a queued job
        self._bytes = 0
        self._busy = 0
        self._cv = threading.Condition()
        self._stopping = False
        self.failures = 0
        self.done = 0
        self._thread = threading.Thread(target=self._loop, name="kvstore-writedown", daemon=True)
        self._thread.start()

    def submit_copy(self, key: ChunkKey, targets: tuple[int, ...]) -> None:
        if not targets:
            return
        with self._cv:
            self._queue.append(Job(key, targets))
            self._cv.notify_all()

    def submit_move(self, key: ChunkKey, header: RecordHeader, blob: bytes, target: int) -> None:
        job = Job(key, (target,), header, blob)
        with self._cv:
            if self._bytes + job.nbytes <= self._budget and not self._stopping:
                self._queue.append(job)
                self._moves[key] = job
                self._bytes += job.nbytes
                self._cv.notify_all()
                return
        self._execute(job)  # back-pressure: over budget, the evicting caller pays

    def pending_move(self, key: ChunkKey) -> tuple[RecordHeader, bytes] | None:
        with self._cv:
            job = self._moves.get(key)
        if job is None or job.header is None or job.blob is None:
            return None
        return job.header, job.blob

    def forget(self, key: ChunkKey) -> None:
        """Drop queued work for a deleted chunk."""
        with self._cv:
            job = self._moves.pop(key, None)
            if job is not None:
                self._bytes -= job.nbytes
                try:
                    self._queue.remove(job)
                except ValueError:
                    pass

    @property
    def pending(self) -> tuple[int, int]:
        """(jobs queued or running, bytes held by queued moves)."""
        with self._cv:
            return len(self._queue) + self._busy, self._bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def stop(self, timeout: float | None = None) -> bool:
        flushed = self.flush(timeout)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)
        return flushed

    def writing(self) -> None:
        """A writer's reserve or commit is being served: write-downs wait a moment."""
        self._writing_at = self._clock()

    def _quiet_locked(self) -> None:
        """Wait (the queue's lock held, released while waiting) until no writer has been
        served for ``quiet_s``, at most ``max_defer_s``; not with a backlog, or stopping."""
        start = self._clock()
        waited = False
        while not self._stopping and len(self._queue) < self._backlog:
            now = self._clock()
            gap = now - self._writing_at
            if gap >= self._quiet_s or now - start >= self._max_defer_s:
                break
            waited = True
            self._cv.wait(min(self._quiet_s - gap, self._max_defer_s - (now - start)))
        if waited:
            self.deferred += 1

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return
                self._quiet_locked()
                if not self._queue:  # forgotten (deleted) while it waited
                    continue
                job = self._queue.popleft()
                self._busy += 1
            try:
                self._execute(job)
            finally:
                with self._cv:
                    self._busy -= 1
                    if self._moves.get(job.key) is job:
                        del self._moves[job.key]
                        self._bytes -= job.nbytes
                    self._cv.notify_all()

    def _execute(self, job: Job) -> None:
        try:
            self._run(job)
            self.done += 1
        except Exception:  # a failed write-down must not kill the thread
            self.failures += 1
            log.exception(
                "write-down of chunk %s to tier(s) %s failed", job.key.hex()[:16], job.targets
            )


class Backlog:
    """Chunks whose copy to a tier failed because the tier was down, to copy again once it
    is back (in arrival order). Bounded: past ``limit`` keys the oldest are forgotten and
    counted in ``dropped`` (those chunks stay in the local tiers, only the copy is lost)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped = 0

    def add(self, key: ChunkKey) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self.limit:
                self._keys.popitem(last=False)
                self.dropped += 1

    def take(self, n: int) -> list[ChunkKey]:
        with self._lock:
            return [self._keys.popitem(last=False)[0] for _ in range(min(n, len(self._keys)))]

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


class Prefetcher:
    """Promotions into L1 off the caller's thread (``TieredStore.prefetch``).

    ``submit`` takes (key, record bytes) pairs and returns at once: a key already
    queued or running is skipped, and past ``budget_bytes`` queued or running the
    rest are dropped (counted in ``dropped``); nothing waits. ``threads`` workers,
    started on first use, run ``promote(key)`` for each; a promotion that raises is
    counted in ``failed`` and logged, and the worker goes on.
    """

    def __init__(
        self, promote: Callable[[ChunkKey], None], budget_bytes: int, threads: int = 2
    ) -> None:
        self._promote = promote
        self.budget = budget_bytes
        self._threads_wanted = threads
        self._queue: deque[tuple[ChunkKey, int]] = deque()
        self._pending: set[ChunkKey] = set()  # queued or running
        self._bytes = 0
        self._busy = 0
        self._cv = threading.Condition()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self.queued = self.done = self.dropped = self.skipped = self.failed = 0

    def submit(self, items: list[tuple[ChunkKey, int]]) -> int:
        """Queue promotions; how many were queued (not already pending, within budget)."""
        n = 0
        with self._cv:
            if self._stopping:
                return 0
            for key, nbytes in items:
                if key in self._pending:
                    self.skipped += 1
                    continue
                if self._bytes + nbytes > self.budget:
                    self.dropped += 1
                    continue
                self._queue.append((key, nbytes))
                self._pending.add(key)
                self._bytes += nbytes
                n += 1
            self.queued += n
            if n:
                if len(self._threads) < self._threads_wanted:
                    self._start_locked()
                self._cv.notify_all()
        return n

    def _start_locked(self) -> None:
        while len(self._threads) < self._threads_wanted:
            t = threading.Thread(
                target=self._loop, name=f"kvstore-prefetch-{len(self._threads)}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                key, nbytes = self._queue.popleft()
                self._busy += 1
            try:
                self._promote(key)
                ok = True
            except Exception as e:  # a failed promotion must not kill the worker
                ok = False
                log.warning(
                    "prefetch of chunk %s failed: %s",
                    key.hex()[:16],
                    e,
                    exc_info=not isinstance(e, KVStoreError),  # a tier that is down: no trace
                )
            with self._cv:
                self._busy -= 1
                self._pending.discard(key)
                self._bytes -= nbytes
                if ok:
                    self.done += 1
                else:
                    self.failed += 1
                self._cv.notify_all()

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Drop what is queued, let running promotions end, and stop the workers."""
        with self._cv:
            self._stopping = True
            self.dropped += len(self._queue)
            for key, nbytes in self._queue:
                self._pending.discard(key)
                self._bytes -= nbytes
            self._queue.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    def detail(self) -> dict[str, int]:
        with self._cv:
            return {
                "prefetch_queued": self.queued,
                "prefetch_done": self.done,
                "prefetch_dropped": self.dropped,
                "prefetch_skipped": self.skipped,
                "prefetch_failed": self.failed,
                "prefetch_pending": len(self._pending),
            }
