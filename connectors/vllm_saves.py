"""The worker half's saves: which chunks of a step to store, their blocks copied out,
and the records stored, in the step (sync) or by the background saver (async).

On the server's host, a step's chunks are reserved in the server's arena in one
round trip (``Client.reserve``, which also says which chunks are stored already:
it replaces the existence check) and the blocks are gathered straight into the
reserved pages: on CPU by ``index_select`` into the arena, on CUDA by one
device-to-host copy into the arena registered with ``cudaHostRegister``. The
checksum goes with the Commit (``checksum_at_commit``): on CPU each layer's
blocks are hashed right after they are gathered, while in cache; on CUDA the
pages are hashed once the copy has landed. Every read of the chunk checks the
pages against it, so a stray write into them before the commit is caught by the
first load (which reads the chunk again with Get: the server deletes a bad one). Copies into a
client's reservations are waited for before that client is closed (a failure
elsewhere), so a late device copy never lands in pages the server has handed
to another writer. A payload split over several extents, a CUDA
arena that cannot be registered, a chunk L1 cannot take now (FULL: the server
puts it below), or a server on another host take the staged path: the blocks
go to a host buffer and the chunk is stored with ``put``.

Sync saves send the step's ReserveMany ahead (``reserve_ahead``), when the worker is
handed the step's metadata, before the forward pass: its round trip runs beside the
forward pass, and the step waits for the gather and the CommitMany only. Not when the
step loads in place: a failed call closes the client, whose arena those loads read.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from vllm.logger import init_logger

from kvstore.keys import ROOT, ChunkKey, Fingerprint, chunk_keys, tokens_to_bytes
from kvstore.records import make_header
from kvstore.sdk import Reservation, unsealed_header
from kvstore.types import PutStatus

from .vllm_blocks import BackgroundSaver, BlockLayout, PinnedArenas
from .vllm_client import BreakerClient
from .vllm_cpus import move_here
from .vllm_meta import SaveSpec, record_blocks
from .vllm_namespace import EngineNamespace

log = init_logger("vllm.kvstore.connector")


@dataclass
class SaveJob:
    """One chunk on its way out: its record's identity and where its bytes are going."""

    key: ChunkKey
    parent: ChunkKey
    fingerprint: Fingerprint
    token_bytes: bytes
    blocks: int
    buf: torch.Tensor  # the arena pages themselves, or a host buffer
    ready: Callable[[], None]  # waits until ``buf`` holds the blocks
    reservation: Reservation | None = None  # written in place: commit it
    staged: bool = False  # a reservation whose bytes are in a host buffer: write, commit
    hasher: Any = None  # xxh3_64 of the payload, fed as the gather wrote it (CPU)
    checksum: int | None = None  # the payload's xxh3_64, when the gather computed it


@dataclass
class _Chunk:
    """One chunk a step saves, before it has a reservation."""

    key: ChunkKey
    parent: ChunkKey
    fp: Fingerprint
    token_bytes: bytes
    blocks: int
    ids: list[int]  # its cache blocks


class _Closing(Exception):
    """The client holding a reservation is being closed: do not start a copy into it."""


def _nothing() -> None:
    return None


class Saves:
    """Starts and stores the saves of one worker (``save_mode`` sync or async)."""

    def __init__(
        self,
        layout: BlockLayout,
        backend: BreakerClient,
        ns: EngineNamespace,
        block_size: int,
        chunk_tokens: int,
        *,
        background: bool,
        save_buffer_bytes: int,
        window: int = 0,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.layout, self.backend, self.ns = layout, backend, ns
        self.block_size, self.chunk_tokens = block_size, chunk_tokens
        self.window = window  # a sliding-window group's: its records hold only a window
        self.saver: BackgroundSaver | None = None
        # Whoever commits a reservation must hold it: the saver's own client in async.
        self.writer = backend
        if background:
            # Its own client: a failure on the saver thread must not close the one the
            # engine thread is reading leases with.
            self.writer = backend.sibling("saver")
            writer = self.writer
            self.saver = BackgroundSaver(
                lambda job: self._store_on(job, writer),
                save_buffer_bytes,
                run_batch=lambda jobs: self.store_all(jobs, writer),
                cpus=cpus,
            )
        self._pins = PinnedArenas()
        # A step's ReserveMany sent ahead: (its specs, its chunks, the answer to come)
        self._ahead: tuple[list[SaveSpec], list[_Chunk], Future[list[Any] | None]] | None = None
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._cpus = cpus  # where the thread sending it runs (vllm_cpus)
        self._lock = threading.Lock()
        self._copying: dict[int, SaveJob] = {}  # copies into reservations that may still run
        self._closing: weakref.WeakSet[Any] = weakref.WeakSet()  # arenas of closing clients
        self.writer.before_close.append(self._settle)

    # -- starting saves, on the engine thread --------------------------------------------
    def start(self, specs: list[SaveSpec], jobs: list[SaveJob]) -> int:
        """Start copying out the chunks of a step's specs that the server lacks: queued on
        the saver (async), or added to ``jobs`` (sync). One ReserveMany for the whole
        step. Returns the chunks skipped for want of room."""
        layout = self.layout
        saver = self.saver
        if self._ahead is not None and not _same(self._ahead[0], specs):
            self.drop_ahead()  # sent for other specs (a step that never saved)
        ahead, self._ahead = self._ahead, None
        skipped = 0
        got: list[Any] | None
        if ahead is not None:
            todo, got = ahead[1], ahead[2].result()
        else:
            todo = self._todo(specs)
            if saver is not None:  # what the budget cannot take is not reserved either
                room, fits = saver.room(), 0
                for c in todo:
                    room -= layout.nbytes(c.blocks)
                    if room < 0 and (fits or saver.pending):
                        break
                    fits += 1
                todo, skipped = todo[:fits], len(todo) - fits
            got = self._reserve(todo) if todo else []
        if got is None:  # no shared memory, or the server is down: ask, then put
            got = [
                PutStatus.EXISTS if here else None
                for here in self.backend.exists([c.key for c in todo])
            ]
        handed: set[int] = set()  # reservations now owned by a job
        try:
            for c, res in zip(todo, got, strict=True):
                if res == PutStatus.EXISTS:
                    continue
                held = res if isinstance(res, Reservation) else None  # FULL/TOO_LARGE: put
                try:
                    if saver is None:
                        jobs.append(self._copy_out(c, held))
                    elif not saver.submit(
                        functools.partial(self._copy_out, c, held),
                        layout.nbytes(c.blocks),
                        c.key,
                    ):
                        skipped += 1
                        continue
                except _Closing:
                    continue  # its client is going away: a failed save, given back below
                except Exception as e:  # this chunk only: a future miss
                    self.backend.failed("save", e)
                    continue
                if held is not None:
                    handed.add(held.id)
        finally:  # whatever no job took is given back, whatever happened
            _give_back([r for r in got if not (isinstance(r, Reservation) and r.id in handed)])
        return skipped

    def reserve_ahead(self, specs: list[SaveSpec]) -> None:
        """Send the ReserveMany for ``specs`` now, on a thread of its own, for the ``start``
        of the same specs to take (sync saves: the step's forward pass runs meanwhile).
        What is not taken is given back by the next ``start`` or ``close``."""
        assert self.saver is None, "async saves reserve on the saver's thread"
        self.drop_ahead()
        todo = self._todo(specs)
        if not todo:
            return
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(
                1, "kvstore-reserve", initializer=move_here, initargs=(self._cpus,)
            )
        self._ahead = (list(specs), todo, self._ahead_pool.submit(self._reserve, todo))

    def drop_ahead(self) -> None:
        """Give back a ReserveMany sent ahead that no ``start`` took."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            with contextlib.suppress(Exception):
                _give_back(ahead[2].result())

    def _todo(self, specs: list[SaveSpec]) -> list[_Chunk]:
        todo: list[_Chunk] = []
        seen: set[ChunkKey] = set()  # requests sharing a prefix complete its chunks together
        for spec in specs:
            try:
                todo += self._chunks(spec, seen)
            except Exception as e:  # a failed save only costs a future hit
                self.backend.failed("save", e)
        return todo

    def _reserve(self, todo: list[_Chunk]) -> list[Any] | None:
        layout = self.layout
        dtype = str(layout.dtype).removeprefix("torch.")
        return self.writer.reserve(
            [
                unsealed_header(
                    c.key, c.parent, c.fp, c.token_bytes, dtype, layout.payload_shape(c.blocks)
                )
                for c in todo
            ]
        )

    def _chunks(self, spec: SaveSpec, seen: set[ChunkKey]) -> list[_Chunk]:
        """The chunks of one spec to save: from its start, none seen in this step or queued."""
        bs, C = self.block_size, self.chunk_tokens
        fp = self.ns.for_request(spec.salt).fingerprint
        raw = tokens_to_bytes(spec.tokens)
        keys = chunk_keys(fp, spec.tokens, C)
        saver = self.saver
        out = []
        for i, s in enumerate(range(0, len(spec.tokens), C)):
            e = min(s + C, len(spec.tokens))
            if s < spec.start or keys[i] in seen or (saver is not None and saver.queued(keys[i])):
                continue
            seen.add(keys[i])
            first, last = record_blocks(bs, self.window, s, e)
            out.append(
                _Chunk(
                    keys[i],
                    keys[i - 1] if i else ROOT,
                    fp,
                    raw[s * 4 : e * 4],
                    last - first,
                    spec.block_ids[first:last],
                )
            )
        return out

    def _copy_out(self, c: _Chunk, held: Reservation | None) -> SaveJob:
        """Start copying one chunk's blocks out of the cache: into its reservation's pages
        when they are one piece (hashed on the way on CPU), else into a host buffer."""
        layout = self.layout
        job = SaveJob(
            c.key, c.parent, c.fp, c.token_bytes, c.blocks, torch.empty(0), _nothing, held
        )
        with self._lock:  # so that _settle sees every copy it must wait for
            into = self._in_place(held)
            job.buf = into if into is not None else layout.host_buffer(layout.nbytes(c.blocks))
            job.staged = held is not None and into is None
            if into is not None and layout.device.type != "cuda":
                # From the cache into the pages in one pass, hashed as they land.
                job.checksum = layout.gather_hashed(c.ids, into.numpy())
                if job.checksum is None:
                    job.hasher = xxhash.xxh3_64()
            if job.checksum is None:
                job.ready = layout.gather(c.ids, job.buf, job.hasher)
            if into is not None:
                self._copying[id(job)] = job
        return job

    def _in_place(self, res: Reservation | None) -> torch.Tensor | None:
        """The reserved pages as a tensor the gather can write into, or None (staged).
        Caller holds ``_lock``."""
        if res is not None and (res.arena.closed or res.arena in self._closing):
            raise _Closing()
        view = res.contiguous() if res is not None else None
        if view is None or res is None:
            return None
        if self.layout.device.type == "cuda" and not self._pins.pin(res.arena):
            return None
        return torch.from_numpy(view)

    # -- storing, in the step (sync) or on the saver thread (async) ----------------------
    def store(self, job: SaveJob, backend: BreakerClient) -> int:
        """Store one chunk once its bytes are in place; the tokens stored (0: not)."""
        tokens = len(job.token_bytes) // 4
        if job.reservation is not None:
            checksum = self._landed(job)
            return tokens if backend.commit(job.reservation, checksum) else 0
        job.ready()
        payload = job.buf.numpy()
        header = make_header(
            key=job.key,
            parent=job.parent,
            fingerprint=job.fingerprint,
            token_bytes=job.token_bytes,
            dtype=str(self.layout.dtype).removeprefix("torch."),
            shape=self.layout.payload_shape(job.blocks),
            payload=memoryview(payload.data),
        )
        return tokens if backend.put(header, payload) else 0

    def _store_on(self, job: SaveJob, backend: BreakerClient) -> int:
        """``store`` on the saver thread: what it raises is reported like any failure."""
        try:
            return self.store(job, backend)
        except Exception as e:  # a failed save only costs a future hit
            backend.failed("save", e)
            return 0

    def store_all(self, jobs: list[SaveJob], backend: BreakerClient) -> list[int]:
        """Store a step's jobs (in the step, or on the saver thread), the ones written in
        place with one CommitMany; the tokens each stored (0: not). Failures are counted,
        never raised."""
        out = [0] * len(jobs)
        batch: list[tuple[int, Reservation, int | None]] = []
        for k, job in enumerate(jobs):
            try:
                if job.reservation is None:
                    out[k] = self.store(job, backend)
                else:
                    batch.append((k, job.reservation, self._landed(job)))
            except Exception as e:  # a failed save only costs a future hit
                backend.failed("save", e)
        if batch:
            stored = backend.commit_many([r for _, r, _ in batch], [c for _, _, c in batch])
            for (k, _, _), ok in zip(batch, stored, strict=True):
                out[k] = len(jobs[k].token_bytes) // 4 if ok else 0
        return out

    def _landed(self, job: SaveJob) -> int | None:
        """Wait until the job's bytes are in its reservation; the checksum for its commit
        (None: the client hashes the pages in place for it). The reservation is given
        back on failure."""
        res = job.reservation
        assert res is not None
        try:
            job.ready()
            if job.staged:
                res.write(job.buf.numpy())
        except BaseException:
            res.abort()
            raise
        finally:
            with self._lock:
                self._copying.pop(id(job), None)
        if job.checksum is not None:
            return job.checksum
        return job.hasher.intdigest() if job.hasher is not None else None

    def _settle(self, client: Any) -> None:
        """The writer's client is about to be closed (its reservations dropped by the
        server, their pages handed out again): no new copy into its arena may start, and
        the copies already under way must land first."""
        arena = getattr(client, "arena", None)
        if arena is None:
            return
        with self._lock:
            self._closing.add(arena)
            running = [
                j
                for j in self._copying.values()
                if j.reservation is not None and j.reservation.arena is arena
            ]
        for job in running:
            with contextlib.suppress(Exception):
                job.ready()

    def close(self, timeout: float) -> None:
        self.drop_ahead()
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=False)
        saver = self.saver
        if saver is not None and not saver.close(timeout=timeout):
            log.warning("kvstore: %d queued save(s) dropped at shutdown", saver.pending)
        if self.writer is not self.backend:
            self.writer.close()  # closed: a save still running stores nothing more
        self._pins.close()


def _same(a: list[SaveSpec], b: list[SaveSpec]) -> bool:
    """Whether ``b`` are the very specs ``a`` holds: the step's metadata's own objects (held,
    so no other spec can have their identities)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _give_back(got: list[Any] | None) -> None:
    for res in got or ():
        if isinstance(res, Reservation):
            with contextlib.suppress(Exception):
                res.abort()
