"""The worker half's loads: the blocks a step's hits cover, read from the server's arena
straight into the paged KV cache.

A step's loads cost a constant number of calls, whatever the number of chunks: the
scheduler's lookup already found the chunks (``LoadSpec.chunks``: keys, stored sizes),
so the worker does not look up again; one AcquireMany lends every chunk of every request
of the batch, and one Release, not waited for, ends the leases once the bytes are
copied. On CPU each payload is copied from the leased pages into its cache blocks in one
pass, hashed as it lands (``Lease.read_scattered``): no host buffer in between; a chunk
only in L2 is lent where it lies in LMDB's file (``disk=True``), not promoted into L1
first. A background load yields to requests computing beside it
(``background_load_share``). A payload whose bytes do not verify is read again with Get
(the server verifies it and deletes a damaged copy, serving a good one from below if it
has one), and is a failed load if that fails too. On CUDA the pages (the arena
registered with ``cudaHostRegister``) go to the device in one transfer per chunk on a
side stream (``BlockLayout.load_cuda``).

What cannot go straight into the cache takes a staged path through a host buffer: a
chunk the arena cannot lend (``USE_GET``: read with Get from the tier below), a stored
chunk of which only a prefix matches, a cache that is not one host allocation, or a
server on another host (Get per chunk). A block that is not loaded (the server is down,
the record is gone, corrupt, of another layout, or its tokens differ) is returned as
failed: vLLM recomputes it. Nothing here raises: an exception in ``start_load_kv``
would kill the engine.

A background load's copies each run under its request's fence (``vllm_async.Ticket``),
so once it is cancelled (a deadline, a preemption) nothing more is written into blocks
vLLM may have handed to someone else.

This module plans a batch (which chunks, which blocks), leases it and ends the leases;
the copy of each chunk, straight, to the device or staged, is ``vllm_copies.ChunkCopies``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.keys import ROOT, ChunkKey, chunk_key, tokens_to_bytes
from kvstore.sdk import USE_GET, LeaseBase, LentLease, ScatterBatch

from .vllm_blocks import BlockLayout, PinnedArenas
from .vllm_client import BreakerClient, Leased
from .vllm_copies import ChunkCopies, ChunkTask
from .vllm_cpus import move_here
from .vllm_layers import LayerCopy, LoadJob
from .vllm_meta import ChunkRef, LoadSpec, Setup, whole_chunks

if TYPE_CHECKING:
    from .vllm_async import Ticket

# Bytes in a batch from which two threads copy it (a load in the step copied before the
# forward pass, or a background load while nothing computes). Measured in
# vLLM on this 2-core host with the second thread on the core vLLM leaves free
# (vllm_cpus): a 4k-token load of 32 MiB took 4.5 ms with two threads against 9.4 ms
# with one. (The 64 MiB this was before had been measured with both threads on one core.)
_SPLIT_BYTES = 16 << 20


@dataclass
class SpecOutcome:
    """What one request's load did."""

    loaded_tokens: int = 0  # tokens whose KV is now in the cache
    failed: set[int] = field(default_factory=set)  # block ids not loaded: vLLM recomputes them


class Loads(ChunkCopies):
    """Loads one worker's hits: ``load`` is the whole load path, one call per batch."""

    def __init__(
        self,
        setup: Setup,
        layout: BlockLayout,
        client: BreakerClient,
        layouts: Sequence[BlockLayout] = (),
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.setup, self.layout, self.client = setup, layout, client
        # Where the second copying thread runs: not where the thread calling ``load`` runs
        # (vllm_cpus). A load in the step is called on the engine thread, bound to the
        # compute cores: its helper goes to the spare ones. The background loader runs on
        # the spare cores: its helper goes to the compute cores, and copies only while
        # nothing computes there.
        self.cpus = cpus
        # A hybrid model's layers by KV-cache group (each group's blocks are its own)
        self.layouts = list(layouts) or [layout]
        self.cuda = layout.device.type == "cuda"
        self._pins = PinnedArenas() if self.cuda else None
        # Leases to end: on CPU after the step's forward pass (``release_done``: off the
        # critical path), on CUDA once the transfers reading their pages (the event) landed.
        self._landing: list[tuple[Any, Leased]] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the second copier
        self._share = setup.cfg.background_load_share
        self.busy = False  # the engine computes this step (the worker sets it each step)
        # Loads in the step copied layer by layer beside the forward pass (vllm_layers);
        # turned off for good if a forward pass is seen reading a layer unwaited.
        self.by_layer = setup.cfg.load_by_layer and not self.cuda
        self._layer_bytes = setup.cfg.load_by_layer_min_bytes  # smaller loads: before it
        self._sleep: Callable[[float], None] = time.sleep  # tests record it
        client.before_close.append(self._settle)

    def load(
        self,
        specs: Sequence[LoadSpec],
        tickets: Sequence[Ticket] | None = None,
        deadline: float | None = None,
    ) -> list[SpecOutcome]:
        """Load every spec of a batch; per spec what was loaded and which blocks were not.

        ``tickets`` (asynchronous loads, one per spec): each copy is fenced by its
        ticket, and on CUDA waited for before this returns. ``deadline``
        (``time.monotonic``): no call to the server waits past it."""
        return self.start(specs, tickets, deadline).finish()

    def start(
        self,
        specs: Sequence[LoadSpec],
        tickets: Sequence[Ticket] | None = None,
        deadline: float | None = None,
        *,
        by_layer: bool = False,
    ) -> LoadJob:
        """``load``, ended by ``LoadJob.finish``. ``by_layer`` (a load in the step, on
        CPU): the chunks that go straight into the cache are copied layer by layer on the
        copying thread while this returns (``vllm_layers``); ``LoadJob.wait`` waits for
        one layer."""
        job = LoadJob(self, specs, [SpecOutcome() for _ in specs])
        tasks: list[ChunkTask] = []
        for i, spec in enumerate(specs):
            try:
                tasks += self._plan(i, spec, job.outs[i].failed)
            except Exception as e:  # a bug, not the server: this request computes instead
                self.client.failed("load", e)
                job.outs[i].failed.update(spec.block_ids)
        drops = dropped_keys(specs, tasks)
        lent: dict[int, LentLease] = {}
        taken: set[int] = set()
        try:
            lent = self.lent(specs)
            taken = self._fetch(
                tasks, tickets, deadline, job, drops, by_layer and self.by_layer, lent
            )
        except Exception as e:  # a bug: every block not loaded yet is recomputed
            self.client.failed("load", e)
        finally:
            # Lent for chunks this batch did not read (no blocks to fill, a second
            # request's lease on the same chunk, a load given up, one this client could
            # not take): ended now.
            self.let_go([x for i, x in lent.items() if i not in taken])
        return job

    def lent(self, specs: Sequence[LoadSpec]) -> dict[int, LentLease]:
        """The leases the scheduler's lookups lent for these specs, by id: this worker's to
        read and end where its namespace is the scheduler's and it writes for it (another
        TP/PP rank reads other keys, and acquires them; of the ranks sharing one copy, an
        MLA model's, only the first takes them, as only it would end them)."""
        out: dict[int, LentLease] = {}
        ns = self.setup.ns
        for spec in specs:
            if (
                spec.groups
                or not ns.writer
                or spec.fingerprint != ns.for_request(spec.salt).fingerprint
            ):
                continue
            for c in spec.chunks:
                if c.lent is not None:
                    out[c.lent.lease_id] = c.lent
        return out

    def let_go(self, lent: Sequence[LentLease]) -> None:
        """End leases lent for loads that will not read them (one Release, not waited for)."""
        if lent:
            self.client.release_lent(lent)

    def _outcomes(self, job: LoadJob) -> list[SpecOutcome]:
        bs = self.setup.block_size
        outs, loaded = job.outs, job.loaded
        for i, spec in enumerate(job.specs):
            first = spec.start // bs
            outs[i].failed.update(b for b in spec.block_ids if (i, b) not in loaded)
            if spec.groups:  # vLLM recomputes such a request whole if any block failed
                outs[i].loaded_tokens = 0 if outs[i].failed else spec.end - spec.start
                continue
            missed = sum(
                min((first + b + 1) * bs, spec.end) - max((first + b) * bs, spec.start)
                for b, block in enumerate(spec.block_ids)
                if block in outs[i].failed
            )
            outs[i].loaded_tokens = (spec.end - spec.start) - missed
        return outs

    # -- which chunks --------------------------------------------------------------------
    def _plan(self, i: int, spec: LoadSpec, failed: set[int]) -> list[ChunkTask]:
        """The chunks of one request's hit and the blocks each fills (of every KV-cache
        group, for a hybrid model)."""
        if not spec.groups:
            chunks = self._chunks(self.setup, spec, spec.chunks, spec.fingerprint)
            return self._plan_group(
                i, self.setup, spec, spec.start, spec.block_ids, chunks, 0, failed
            )
        tasks = []
        for part in spec.groups:
            gs = self.setup.for_group(part.group)
            chunks = self._chunks(gs, spec, part.chunks, part.fingerprint)
            tasks += self._plan_group(
                i, gs, spec, part.start, part.block_ids, chunks, part.group, failed
            )
        return tasks

    def _plan_group(
        self,
        i: int,
        s: Setup,
        spec: LoadSpec,
        start: int,
        block_ids: list[int],
        chunks: Sequence[ChunkRef],
        group: int,
        failed: set[int],
    ) -> list[ChunkTask]:
        bs = s.block_size
        todo = dict(zip(range(start // bs, s.blocks(spec.end)), block_ids, strict=True))
        tasks = []
        for c in chunks:
            # A sliding window's record holds only its last blocks (Setup.record_blocks).
            first, last = s.record_blocks(c.start, c.start + c.stored_tokens)
            blocks = [b for b in range(first, min(last, (c.start + c.tokens) // bs)) if b in todo]
            if not blocks:
                continue
            # A partial match rests on 8-byte sub-hashes; the record's own token ids have
            # the last word, so colliding tokens are recomputed, never loaded.
            check = tokens_to_bytes(spec.tokens[c.start : c.start + c.tokens]) if c.partial else b""
            ids = [todo.pop(b) for b in blocks]
            tasks.append(ChunkTask(i, c.key, last - first, blocks[0] - first, ids, check, group))
        failed.update(todo.values())  # not stored (any more)
        return tasks

    def _chunks(
        self, s: Setup, spec: LoadSpec, chunks: tuple[ChunkRef, ...], fingerprint: bytes
    ) -> Sequence[ChunkRef]:
        """The scheduler's chunks, keyed in this worker's namespace (``s``: the group's)."""
        fp = s.ns.for_request(spec.salt).fingerprint
        if chunks and fp == fingerprint:
            return chunks
        if chunks and not any(c.partial for c in chunks):
            # Another TP/PP rank: the same chunks under this rank's keys, chained as saves
            # chain them (a partial match's key is a stored sibling's, unknown here).
            out, parent = [], ROOT
            for c in chunks:
                raw = tokens_to_bytes(spec.tokens[c.start : c.start + c.stored_tokens])
                parent = chunk_key(parent, fp, raw)
                out.append(c._replace(key=parent, lent=None))
            return out
        ns = s.ns.for_request(spec.salt)
        result = self.client.lookup(ns, spec.tokens, granularity=s.block_size, worker=True)
        found = [
            ChunkRef(m.key, m.start, m.tokens, m.stored_tokens, m.partial)
            for m in (result.chunks if result else ())
        ]
        return whole_chunks(found) if s.window else found

    # -- moving bytes --------------------------------------------------------------------
    def _fetch(
        self,
        tasks: list[ChunkTask],
        tickets: Sequence[Ticket] | None,
        deadline: float | None,
        job: LoadJob,
        drops: frozenset[bytes] = frozenset(),
        by_layer: bool = False,
        given: dict[int, LentLease] | None = None,
    ) -> set[int]:
        """``given``: leases the scheduler's lookup lent, read instead of acquired; the ids
        of those taken (the caller ends the others)."""
        loaded = job.loaded
        if not tasks:
            return set()
        self.release_done()
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return set()
        if not self.client.shm_active():  # a server on another host: Get per chunk
            for t in tasks:
                ticket = tickets[t.spec] if tickets is not None else None
                self._staged(t, None, ticket, deadline, loaded)
            self.client.drop_later([k for k in dict.fromkeys(t.key for t in tasks) if k in drops])
            return set()
        keys = list(dict.fromkeys(t.key for t in tasks))  # requests sharing a prefix
        leased, taken = self._leases(keys, left, given or {})
        if leased is None:
            return taken  # the server is down: every block is reported
        # Dropped in the Release that ends the leases, once the bytes are in the cache.
        leased = leased._replace(drop=tuple(k for k in keys if k in drops))
        lent = dict(zip(keys, leased.items, strict=True))
        arena = leased.client.arena
        later: list[ChunkTask] = []
        events: list[Any] = []
        now: list[tuple[ChunkTask, LeaseBase, Ticket | None]] = []
        for t in tasks:
            lease = lent[t.key]
            ticket = tickets[t.spec] if tickets is not None else None
            if lease is USE_GET:
                later.append(t)  # after the copies: a failed Get may close the client
            elif isinstance(lease, LeaseBase) and self._fits(t, lease):
                now.append((t, lease, ticket))
        try:
            nbytes = sum(lease.header.raw_size for _, lease, _ in now)
            if by_layer and tickets is None and not self.cuda and nbytes >= self._layer_bytes:
                now = self._start_layers(now, job)
                nbytes = sum(lease.header.raw_size for _, lease, _ in now)
            # A background load (tickets) copies on this thread alone while the engine
            # computes (decodes, other prefills): a second copying thread would take a
            # core from its compute threads, not from idle time. With nothing computing,
            # the compute cores are idle: two threads copy, as in the step.
            busy = tickets is not None and self.busy
            if self.cuda or busy or len(now) < 2 or nbytes < _SPLIT_BYTES:
                self._copy_all(now, arena, loaded, events)
            else:
                # Two threads copy (the native copy lets go of the GIL): one core's copy
                # reaches only part of the memory bandwidth, and before the forward pass
                # the engine's compute threads wait for this anyway.
                theirs: set[tuple[int, int]] = set()
                other = self._helper().submit(self._copy_all, now[1::2], arena, theirs, [])
                try:
                    self._copy_all(now[0::2], arena, loaded, events)
                finally:
                    other.result()
                    loaded |= theirs
        finally:
            # CUDA: the pages are read until the transfers land.
            self._landing.append((events[-1] if events else None, leased))
        for t in later:
            ticket = tickets[t.spec] if tickets is not None else None
            self._staged(t, None, ticket, deadline, loaded)
        return taken

    def _leases(
        self, keys: list[ChunkKey], left: float | None, lent: dict[int, LentLease]
    ) -> tuple[Leased | None, set[int]]:
        """Per key a lease (lent by the lookup, or acquired here), ``USE_GET`` or None
        (None: the server is down), and the ids of the lent leases taken. What the lookup
        lent is taken (``adopt``: no call); the rest comes in one AcquireMany (a chunk
        only in L2 lent where it lies in LMDB's file where Setup.reads_disk says so: one
        pass, not promoted first), and a second where a lent lease could not be taken."""
        by_key: dict[bytes, LentLease] = {}
        for x in lent.values():
            by_key.setdefault(x.key, x)
        mine = [by_key[k] for k in keys if k in by_key]
        got: dict[bytes, Any] = {}
        taken: set[int] = set()
        if mine:
            adopted = self.client.adopt(mine) or [None] * len(mine)
            for x, lease in zip(mine, adopted, strict=True):
                if lease is not None:
                    got[x.key] = lease
                    taken.add(x.lease_id)
        rest = [k for k in keys if k not in got]
        acquired = self.client.acquire_many(rest, left, disk=self.setup.reads_disk)
        if acquired is None:
            # A failed call closed the client, its mappings with it: nothing is read
            # through the leases taken, which run out after lease_ms.
            return None, taken
        got.update(zip(rest, acquired.items, strict=True))
        return Leased(acquired.client, [got[k] for k in keys]), taken

    def _start_layers(
        self, now: list[tuple[ChunkTask, LeaseBase, Ticket | None]], job: LoadJob
    ) -> list[tuple[ChunkTask, LeaseBase, Ticket | None]]:
        """Start the layer by layer copy of the chunks that go straight into the cache;
        those that do not, returned, are copied before the forward pass as before."""
        batch = ScatterBatch(self.layout.flat)
        rest = []
        for t, lease, ticket in now:
            try:
                parts = self.layout.layer_pieces(t.stored, t.first, t.ids) if not t.group else None
                if parts is not None:
                    batch.add(lease, parts)
                    job.by_layer.append(t)
                    continue
            except Exception as e:  # a bug: this chunk's blocks are recomputed
                self.client.failed("load", e)
                continue
            rest.append((t, lease, ticket))
        if job.by_layer:
            job.copy = LayerCopy(batch, self._helper(), self.setup.cfg.timeout_ms / 1000)
        return rest

    def _helper(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, "kvstore-copy", initializer=move_here, initargs=(self.cpus,)
            )
        return self._pool

    # -- ending leases ----------------------------------------------------------------------
    def release_done(self) -> None:
        """End, with one Release not waited for, the leases whose bytes are in the cache
        (on CUDA: whose transfers have landed). The worker calls it after the forward
        pass; the background loader once it has reported the batch (``AsyncLoads``)."""
        keep = []
        for event, leased in self._landing:
            if event is None or event.query():
                self.client.release_later(leased)
            else:
                keep.append((event, leased))
        self._landing = keep

    def _settle(self, client: Any) -> None:
        """Before the client (and its arena mapping) goes: let the transfers out of it land."""
        for event, _ in self._landing:
            if event is not None:
                event.synchronize()
        self._landing = []

    def close(self) -> None:
        self._settle(None)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._pins is not None:
            self._pins.close()


def dropped_keys(specs: Sequence[LoadSpec], tasks: Sequence[ChunkTask]) -> frozenset[bytes]:
    """drop_after_load: the chunks a batch loads for requests that asked to drop them,
    less those another request of the batch loads without asking, and less records a
    request matched only a prefix of (another prompt's, whose own consumer may still be
    about to load it)."""
    drop = {
        t.key
        for t in tasks
        if specs[t.spec].drop and (not t.check or t.first + len(t.ids) >= t.stored)
    }
    return frozenset(drop - {t.key for t in tasks if not specs[t.spec].drop})
