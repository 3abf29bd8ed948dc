"""Whole-block byte copies between vLLM's paged KV cache and chunk payloads.

vLLM 0.32 gives each layer a logical ``[num_blocks, ...]`` view over one shared
allocation whose physical order depends on the attention backend (LBHNC on CPU,
LBNHC for CUDA FlashAttention), and on CPU the bytes inside a block are packed
by the kernel, so per-token slicing is wrong (vllm-notes.md section 2). What is
always right is to move a block's bytes as they are: each layer is re-viewed
here as ``[num_blocks, block_bytes]`` over its storage, using its block stride,
and blocks are gathered or scattered with one ``index_select``/``index_copy_``
per layer. A chunk payload is ``[layers, blocks, block_bytes]`` in the forward
pass's layer order (``layer_order``); its first m blocks are a valid payload for m
blocks.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from math import prod
from typing import Any

import torch

from kvstore import accel
from kvstore.errors import InvalidArgument

from .vllm_cpus import move_here
from .vllm_namespace import layer_order


def _dense_inner(t: torch.Tensor) -> bool:
    """Dims 1.. of ``t`` cover one dense region (in some order), so a block is contiguous bytes."""
    dims = sorted((t.stride(i), t.shape[i]) for i in range(1, t.dim()) if t.shape[i] > 1)
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return False
        expect *= size
    return True


class BlockLayout:
    """Byte views of every layer's blocks, and gather/scatter of whole blocks."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise InvalidArgument("no KV cache tensors were registered")
        self.names = layer_order(kv_caches)
        self.views: list[torch.Tensor] = []
        first = kv_caches[self.names[0]]
        self.dtype = first.dtype
        self.device = first.device
        self.itemsize = first.element_size()
        self.block_bytes = prod(first.shape[1:]) * self.itemsize
        self.num_blocks = first.shape[0]
        # CUDA: saves gather, and loads copy, on their own stream (see gather, load_cuda)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Where each layer's block 0 starts in its storage, and the bytes between blocks:
        # what ``pieces`` needs to place a payload's blocks straight into the cache.
        self._at: list[tuple[int, int]] = []
        storages: set[int] = set()
        for name in self.names:
            t = kv_caches[name]
            bb = prod(t.shape[1:]) * t.element_size()
            if bb != self.block_bytes or t.dtype != self.dtype or t.shape[0] != self.num_blocks:
                raise InvalidArgument(
                    f"layer {name}: {tuple(t.shape)} {t.dtype} differs from {self.names[0]}; "
                    "kvstore needs one KV layout for every layer (hybrid models are not supported)"
                )
            if not _dense_inner(t) or t.stride(0) * t.element_size() < bb:
                raise InvalidArgument(
                    f"layer {name}: a block is not one dense byte range (shape {tuple(t.shape)}, "
                    f"strides {t.stride()}); this KV layout is not supported"
                )
            storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            storages.add(t.untyped_storage().data_ptr())
            self._at.append((t.storage_offset() * t.element_size(), t.stride(0) * t.element_size()))
            self.views.append(
                torch.as_strided(
                    storage,
                    (t.shape[0], bb),
                    (t.stride(0) * t.element_size(), 1),
                    t.storage_offset() * t.element_size(),
                )
            )

        # The whole cache as one byte array, when every layer lives in one allocation on
        # the host (vLLM's CPU layout): loads copy a payload into its blocks in one pass.
        self.flat: Any = None
        if self.device.type == "cpu" and len(storages) == 1:
            self.flat = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage()).numpy()

    @property
    def layers(self) -> int:
        return len(self.views)

    def pieces(
        self, stored_blocks: int, first: int, block_ids: Sequence[int]
    ) -> list[tuple[int, int]] | None:
        """Where each byte of a payload of ``stored_blocks`` blocks goes in ``flat`` to
        load its blocks ``first .. first + len(block_ids) - 1`` into ``block_ids``:
        (offset, length) pieces in payload order, covering it exactly once, for
        ``Lease.read_scattered``. A block before ``first`` (computed locally, or in
        vLLM's own prefix cache) lands in the first loaded block of its layer, which the
        bytes that follow overwrite: the whole payload is still hashed as it lands, and
        nothing outside the request's own blocks is written. None when this cannot be
        done in place: no single host allocation, or blocks after the last one loaded
        (a stored chunk of which only a prefix matches), which would have nowhere to go."""
        by_layer = self.layer_pieces(stored_blocks, first, block_ids)
        return None if by_layer is None else [p for layer in by_layer for p in layer]

    def layer_pieces(
        self, stored_blocks: int, first: int, block_ids: Sequence[int]
    ) -> list[list[tuple[int, int]]] | None:
        """``pieces``, per layer (the payload's parts, in order)."""
        n, bb = len(block_ids), self.block_bytes
        if self.flat is None or not n or first + n != stored_blocks:
            return None
        out: list[list[tuple[int, int]]] = []
        for base, stride in self._at:
            layer = [(base + block_ids[0] * stride, bb)] * first
            for b in block_ids:
                at = base + b * stride
                if layer and layer[-1][0] + layer[-1][1] == at:  # the next block in memory
                    layer[-1] = (layer[-1][0], layer[-1][1] + bb)
                else:
                    layer.append((at, bb))
            out.append(layer)
        return out

    def describe(self) -> str:
        """The part of the namespace that the bytes depend on."""
        return (
            f"{self.layers}x{self.num_blocks and self.block_bytes}B/"
            f"{str(self.dtype).removeprefix('torch.')}/{self.device.type}"
        )

    def nbytes(self, n_blocks: int) -> int:
        """Bytes of a chunk payload of ``n_blocks`` blocks."""
        return self.layers * n_blocks * self.block_bytes

    def payload_shape(self, n_blocks: int) -> tuple[int, int, int]:
        """The chunk payload's shape in elements of the KV dtype."""
        return (self.layers, n_blocks, self.block_bytes // self.itemsize)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer for chunk bytes: pinned for a CUDA cache, so copies run asynchronously."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def gather_hashed(self, block_ids: Sequence[int], out: Any) -> int | None:
        """CPU, one allocation: copy the blocks into ``out`` (a writable uint8 array of the
        payload's size: the reserved arena pages) in one pass, hashed as they land, on
        this thread; their xxh3_64, or None when the cache is not one host allocation.
        No torch op, so no intra-op thread pool to contend with other processes for."""
        pieces = self.pieces(len(block_ids), 0, block_ids)
        if pieces is None:
            return None
        trips, pos = [], 0
        for at, n in pieces:
            trips.append((pos, at, n))
            pos += n
        return int(accel.scatter_xxh3(out, self.flat, trips, True))

    def gather(
        self, block_ids: Sequence[int], out: torch.Tensor, hasher: Any = None
    ) -> Callable[[], None]:
        """Start copying blocks into ``out`` (uint8, ``layers * len(block_ids) * block_bytes``).

        ``hasher`` (CPU only, an ``xxhash.xxh3_64``) is fed each layer's bytes right after
        they are gathered, while they are still in cache: the payload's checksum in order.

        Returns a function that waits until the bytes are in ``out``. On CPU the copy is done
        on return. On CUDA the blocks are gathered on a side stream once the step's kernels
        have written them, then copied to ``out`` in one device-to-host transfer that overlaps
        the next forward pass; the compute stream waits only for the gather (device memory
        speed), so a block freed and rewritten later is never read half-written.
        """
        n = len(block_ids)
        dst = out.view(self.layers, n, self.block_bytes)
        if self._side is None:
            idx = self._indices(block_ids)
            for i, view in enumerate(self.views):
                if view.device == dst.device:
                    torch.index_select(view, 0, idx, out=dst[i])
                else:  # another accelerator: gather there, then one copy
                    dst[i].copy_(torch.index_select(view, 0, idx))
                if hasher is not None:
                    hasher.update(dst[i].numpy().data)
            return _done
        if hasher is not None:
            raise InvalidArgument("a CUDA gather cannot hash its bytes on the way")
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            idx = self._indices(block_ids)
            # Allocated on the side stream: the allocator reuses it only after this
            # stream's later work, so dropping it before the copy ends is safe.
            staged = torch.empty(
                (self.layers, n, self.block_bytes), dtype=torch.uint8, device=self.device
            )
            for i, view in enumerate(self.views):
                torch.index_select(view, 0, idx, out=staged[i])
            read = torch.cuda.Event()
            read.record(self._side)
            dst.copy_(staged, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._side)
        main.wait_event(read)
        return copied.synchronize

    def scatter(
        self, src: torch.Tensor, stored_blocks: int, block_ids: Sequence[int], first: int = 0
    ) -> None:
        """Copy ``len(block_ids)`` blocks of a payload, from its block ``first``, into the cache.

        On CUDA the copies are queued on the compute stream, ahead of the forward pass that
        reads them, and return without waiting; a pinned ``src`` is kept by torch's host
        allocator until its copy has run.
        """
        n = len(block_ids)
        if first + n > stored_blocks:
            raise InvalidArgument(
                f"asked for blocks {first}..{first + n - 1} of a chunk holding {stored_blocks}"
            )
        data = src.view(self.layers, stored_blocks, self.block_bytes)
        if data.device != self.device:
            # The whole chunk in one transfer, sliced on the device: a strided slice of
            # host memory would go through a pageable copy that waits for the GPU.
            data = data.to(self.device, non_blocking=True)
        data = data[:, first : first + n]
        idx = self._indices(block_ids)
        for i, view in enumerate(self.views):
            view.index_copy_(0, idx, data[i])

    def load_cuda(
        self, src: Any, stored_blocks: int, block_ids: Sequence[int], first: int = 0
    ) -> Any:
        """CUDA: queue the copy of a payload's blocks ``first ..`` into ``block_ids`` from
        host memory registered with CUDA (the arena's leased pages, ``src`` a uint8 array
        over them) on the side stream: one host-to-device transfer straight from the
        arena, then the blocks scattered on the device. Returns the event recorded after
        them: the compute stream waits for it (a load the step needs), or the host does
        (a background load, and before the lease is released: until then the transfer
        may still read the pages)."""
        if self._side is None:
            raise InvalidArgument("load_cuda needs a CUDA cache")
        n = len(block_ids)
        if first + n > stored_blocks:
            raise InvalidArgument(
                f"asked for blocks {first}..{first + n - 1} of a chunk holding {stored_blocks}"
            )
        # After the work already queued: a block freed and handed to this request may
        # still be read by kernels of an earlier step.
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            host = torch.from_numpy(src)
            # Allocated on the side stream, so reused only after this stream's later work.
            data = host.to(self.device, non_blocking=True)
            data = data.view(self.layers, stored_blocks, self.block_bytes)[:, first : first + n]
            idx = self._indices(block_ids)
            for i, view in enumerate(self.views):
                view.index_copy_(0, idx, data[i])
            done = torch.cuda.Event()
            done.record(self._side)
        return done

    def synchronize(self) -> None:
        """CUDA: wait for the work queued on this thread's current stream."""
        if self._side is not None:
            torch.cuda.current_stream(self.device).synchronize()

    def wait_on_compute(self, event: Any) -> None:
        """CUDA: the compute stream waits for ``event`` (a load this step's forward reads)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def _indices(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids on the cache's device, without making the host wait for the GPU.

        A plain ``torch.tensor(..., device="cuda")`` is a blocking copy: it waits for every
        kernel queued on the stream, i.e. for the forward pass to finish.
        """
        if self._side is None:
            return torch.tensor(block_ids, dtype=torch.long, device=self.device)
        host = torch.tensor(block_ids, dtype=torch.long, pin_memory=True)
        return host.to(self.device, non_blocking=True)


def _done() -> None:
    return None


_END_BATCH = "end of batch"  # BackgroundSaver's queue: the jobs before it are one batch


class PinnedArenas:
    """Arena mappings registered with CUDA (``cudaHostRegister``), each once.

    A device-to-host copy into pageable memory makes the host wait for the GPU; into
    registered memory it is asynchronous and runs at pinned speed. Each client maps
    the arena on its own, so registration is per mapping (a reconnect brings a new
    one). A registered mapping is kept referenced (the memory must stay mapped while
    registered, and its id must not be reused) until its client has closed and the
    next registration finds it so, or ``close``.
    """

    def __init__(self) -> None:
        self._done: dict[int, tuple[Any, Any]] = {}  # id(mapping) -> (mapping, array or None)

    def pin(self, arena: Any) -> bool:
        """Register ``arena`` (an ``ArenaView``) if not yet; False if CUDA refused."""
        entry = self._done.get(id(arena))
        if entry is not None:
            return entry[1] is not None
        self._release_closed()
        whole = arena.array
        try:
            rc = torch.cuda.cudart().cudaHostRegister(whole.ctypes.data, whole.size, 0)
            ok = int(rc[0] if isinstance(rc, tuple) else rc) == 0
        except Exception:  # no CUDA runtime bindings: the caller stages instead
            ok = False
        self._done[id(arena)] = (arena, whole if ok else None)
        return ok

    def _release_closed(self) -> None:
        """Unregister mappings whose client has closed (a reconnect), once no copy into
        them can still be running: a device-wide sync, on this rare path only."""
        stale = [k for k, (arena, _) in self._done.items() if arena.closed]
        if not stale:
            return
        torch.cuda.synchronize()
        for k in stale:
            _, whole = self._done.pop(k)
            if whole is not None:
                with contextlib.suppress(Exception):
                    torch.cuda.cudart().cudaHostUnregister(whole.ctypes.data)

    def close(self) -> None:
        for _, whole in self._done.values():
            if whole is not None:
                with contextlib.suppress(Exception):
                    torch.cuda.cudart().cudaHostUnregister(whole.ctypes.data)
        self._done.clear()


class BackgroundSaver:
    """Runs save jobs on one thread, in order, so the engine's step does not wait for them.

    ``run(job)`` does one save (wait for its bytes, build the record, put it) and returns
    the tokens it stored (0: not stored, counted as failed). Pending jobs hold host
    buffers, so their bytes are bounded: ``submit`` reserves a job's bytes before it
    builds the job (allocating its buffer and starting its copies), and a job that would
    pass ``max_pending_bytes`` is refused before any of that (the caller counts a skipped
    save, a future miss) rather than stalling the engine or growing without limit.

    With ``run_batch(jobs) -> [tokens]`` the jobs submitted between two ``end_batch``
    calls (one engine step's) are stored together, so that a step's chunks cost one
    CommitMany, not a Commit each.
    """

    def __init__(
        self,
        run: Callable[[Any], int],
        max_pending_bytes: int,
        run_batch: Callable[[list[Any]], list[int]] | None = None,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self._run = run
        self.cpus = cpus  # where the saver thread runs (vllm_cpus); None: where it starts
        self._run_batch = run_batch
        self.max_pending_bytes = max_pending_bytes
        self._jobs: queue.SimpleQueue[tuple[Any, int, Hashable] | str | None] = queue.SimpleQueue()
        self._keys: set[Hashable] = set()  # keys of queued jobs: a chunk is saved once
        self._cond = threading.Condition()
        self._pending_bytes = 0
        self._pending_jobs = 0
        self.saved_tokens = 0  # totals, read and reset by the owner with ``take``
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name="kvstore-saver", daemon=True)
        self._thread.start()

    def room(self) -> int:
        """Bytes that can be submitted before the budget refuses (when jobs are pending)."""
        with self._cond:
            return self.max_pending_bytes - self._pending_bytes

    def queued(self, key: Hashable) -> bool:
        """A job for ``key`` is waiting or running."""
        with self._cond:
            return key in self._keys

    def submit(self, make: Callable[[], Any], nbytes: int, key: Hashable = None) -> bool:
        """Reserve ``nbytes``, build the job with ``make()`` and queue it; False (and
        ``make`` not called) when that would pass the budget."""
        with self._cond:
            if self._pending_jobs and self._pending_bytes + nbytes > self.max_pending_bytes:
                return False
            self._pending_bytes += nbytes
            self._pending_jobs += 1
            self._keys.add(key)
        try:
            job = make()
        except BaseException:
            self._finished(nbytes, key, 0, 0)
            raise
        self._jobs.put((job, nbytes, key))
        return True

    def end_batch(self) -> None:
        """The jobs submitted since the last call are one batch (``run_batch``)."""
        if self._run_batch is not None:
            self._jobs.put(_END_BATCH)

    def _loop(self) -> None:
        move_here(self.cpus)
        batch: list[tuple[Any, int, Hashable]] = []
        while (item := self._jobs.get()) is not None:
            if isinstance(item, str):  # _END_BATCH
                self._batch(batch)
                batch = []
            elif self._run_batch is not None:
                batch.append(item)
            else:
                job, nbytes, key = item
                try:
                    tokens = self._run(job)
                except Exception:  # the owner's run reports its own failures
                    tokens = 0
                self._finished(nbytes, key, tokens, 0 if tokens else 1)
        self._batch(batch)

    def _batch(self, batch: list[tuple[Any, int, Hashable]]) -> None:
        if not batch:
            return
        assert self._run_batch is not None
        try:
            stored = self._run_batch([job for job, _, _ in batch])
        except Exception:  # the owner's run reports its own failures
            stored = [0] * len(batch)
        for (_, nbytes, key), tokens in zip(batch, stored, strict=True):
            self._finished(nbytes, key, tokens, 0 if tokens else 1)

    def _finished(self, nbytes: int, key: Hashable, tokens: int, failed: int) -> None:
        with self._cond:
            self.saved_tokens += tokens
            self.errors += failed
            self._pending_bytes -= nbytes
            self._pending_jobs -= 1
            self._keys.discard(key)
            self._cond.notify_all()

    def take(self) -> tuple[int, int]:
        """(tokens saved, jobs failed) since the last call."""
        with self._cond:
            out = (self.saved_tokens, self.errors)
            self.saved_tokens = self.errors = 0
            return out

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending_jobs

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted job has run; False if some are still pending."""
        self.end_batch()
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_jobs == 0, timeout)

    def close(self, timeout: float) -> bool:
        done = self.drain(timeout)
        self._jobs.put(None)
        self._thread.join(timeout if done else 0)
        return done
