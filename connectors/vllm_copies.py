"""The worker's copies of one chunk at a time into the paged KV cache: straight out of
its leased pages (hashed as they land), to the device on CUDA, or staged through a host
buffer, and what a chunk whose bytes did not verify does (read again with Get).

A mixin of ``vllm_loads.Loads`` (``ChunkCopies``), split out so that neither module grows
past what one sitting reads: ``vllm_loads`` decides which chunks a batch loads, leases
them in one call and ends the leases; this moves one chunk's bytes. It works on the
loader's layouts, client and settings, declared below for the type checker. Nothing here
raises into the engine: ``_copy_all`` reports a failed chunk and its blocks are recomputed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvstore.keys import ChunkKey
from kvstore.sdk import LeaseBase

from .vllm_blocks import BlockLayout, PinnedArenas
from .vllm_client import BreakerClient

if TYPE_CHECKING:
    from .vllm_async import Ticket


@dataclass
class ChunkTask:
    """One chunk to load for one request."""

    spec: int  # index of its spec
    key: ChunkKey
    stored: int  # blocks the record holds
    first: int  # the record's block that goes to ids[0]
    ids: list[int]  # cache blocks to fill, in order
    check: bytes  # token ids the record must start with (partial matches), or b""
    group: int = 0  # the KV-cache group whose layers the record holds (hybrid models)


class ChunkCopies:
    if TYPE_CHECKING:  # the loader's state this works on (``Loads`` sets it up)
        layout: BlockLayout
        layouts: list[BlockLayout]
        client: BreakerClient
        cuda: bool
        busy: bool
        _pins: PinnedArenas | None
        _share: float
        _sleep: Callable[[float], None]

    def _copy_all(
        self,
        todo: list[tuple[ChunkTask, LeaseBase, Ticket | None]],
        arena: Any,
        loaded: set[tuple[int, int]],
        events: list[Any],
    ) -> None:
        for t, lease, ticket in todo:
            t0 = time.perf_counter()
            try:
                self._copy(t, lease, arena, ticket, loaded, events)
            except Exception as e:  # a bug: this chunk's blocks are recomputed
                self.client.failed("load", e)
            if ticket is not None and self.busy and self._share < 1:
                # A background load while the engine computes others: it copies its share
                # of the time. Flat out, its copies and the decodes' steps fight over the
                # spare core (vLLM's engine-core process runs there too) and over memory
                # bandwidth: their inter-token latency rose 1.22-1.29x during a 16k load
                # from L2, against 1.19x at a third of the time (docs/performance.md).
                self._sleep((time.perf_counter() - t0) * (1 / self._share - 1))

    def _fits(self, t: ChunkTask, lease: LeaseBase) -> bool:
        """The record is of this layout and, for a partial match, of these tokens."""
        header = lease.header
        if header.raw_size != self.layouts[t.group].nbytes(t.stored):
            return False
        return not t.check or header.token_bytes[: len(t.check)] == t.check

    def _copy(
        self,
        t: ChunkTask,
        lease: LeaseBase,
        arena: Any,
        ticket: Ticket | None,
        loaded: set[tuple[int, int]],
        events: list[Any],
    ) -> None:
        layout = self.layouts[t.group]
        if self.cuda:
            self._copy_cuda(t, lease, arena, ticket, loaded, events)
            return
        pieces = layout.pieces(t.stored, t.first, t.ids)
        if pieces is None:
            self._staged(t, lease, ticket, None, loaded)
            return
        with _fence(ticket) as go:
            if not go:
                return
            if lease.read_scattered(layout.flat, pieces):
                self._landed(t, ticket, loaded)
                return
        self._reread(t, ticket, loaded)

    def _copy_cuda(
        self,
        t: ChunkTask,
        lease: LeaseBase,
        arena: Any,
        ticket: Ticket | None,
        loaded: set[tuple[int, int]],
        events: list[Any],
    ) -> None:
        views = lease.views()
        assert self._pins is not None
        if len(views) != 1 or arena is None or not self._pins.pin(arena):
            self._staged(t, lease, ticket, None, loaded)
            return
        src = np.frombuffer(views[0], dtype=np.uint8)
        with _fence(ticket) as go:
            if not go:
                return
            event = self.layouts[t.group].load_cuda(src, t.stored, t.ids, t.first)
            if ticket is not None:
                ticket.events.append(event)
            events.append(event)
        if ticket is None:
            self.layout.wait_on_compute(event)
        # Hashed on the host while the transfer runs: the leased pages cannot change
        # before the release, which waits for the transfer.
        if xxhash.xxh3_64_intdigest(views[0]) == lease.header.payload_checksum:
            self._landed(t, ticket, loaded)
        else:
            # The bad transfer lands first: a background load's scatter goes on another
            # stream than the transfer and could otherwise be overwritten by it.
            event.synchronize()
            self._reread(t, ticket, loaded)

    def _staged(
        self,
        t: ChunkTask,
        lease: LeaseBase | None,
        ticket: Ticket | None,
        deadline: float | None,
        loaded: set[tuple[int, int]],
    ) -> None:
        """Through a host buffer: out of a lease, verified, or by Get (verified by the
        server), then scattered into the blocks."""
        layout = self.layouts[t.group]
        buf = layout.host_buffer(layout.nbytes(t.stored))
        if lease is not None:
            if not lease.read_verified(buf.numpy()):
                self._reread(t, ticket, loaded)
                return
        else:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            header = self.client.get_into(t.key, buf, left)
            if header is None or header.raw_size != buf.numel():
                return
            if t.check and header.token_bytes[: len(t.check)] != t.check:
                return
        with _fence(ticket) as go:
            if not go:
                return
            layout.scatter(buf, t.stored, t.ids, first=t.first)
            if self.cuda and ticket is not None:  # queued on this thread's stream
                layout.synchronize()
            self._landed(t, ticket, loaded)

    def _reread(self, t: ChunkTask, ticket: Ticket | None, loaded: set[tuple[int, int]]) -> None:
        """A leased chunk whose bytes did not verify here: read it again with Get. The
        server verifies what it serves, so a record damaged in its arena (a stray or
        faulty writer: the commit does not hash the payload) is counted and deleted
        there, not left to fail every load and block its own re-save; an intact one (the
        pages were changed only while this copy ran) still lands. Rare: one call each."""
        if ticket is not None and ticket.cancelled:
            return
        # No deadline of its own: the call's timeout bounds it, and the ticket's fence
        # keeps a late answer out of blocks a cancelled load no longer owns.
        self._staged(t, None, ticket, None, loaded)

    def _scrub(self, t: ChunkTask) -> None:
        """A chunk copied layer by layer whose bytes did not verify (its blocks are
        reported failed: the forward pass used them): read it with Get, so the server
        verifies its copy and deletes it if it is the damaged one (``_reread``)."""
        layout = self.layouts[t.group]
        self.client.get_into(t.key, layout.host_buffer(layout.nbytes(t.stored)), None)

    def _landed(self, t: ChunkTask, ticket: Ticket | None, loaded: set[tuple[int, int]]) -> None:
        loaded.update((t.spec, b) for b in t.ids)
        if ticket is not None:
            ticket.loaded.update(t.ids)


def _fence(ticket: Ticket | None) -> contextlib.AbstractContextManager[bool]:
    """The ticket's fence around one copy (True: go ahead), or none for a load in the step."""
    return ticket.copying() if ticket is not None else contextlib.nullcontext(True)
