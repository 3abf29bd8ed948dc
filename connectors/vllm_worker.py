"""The worker half of the connector, in each vLLM worker process: it moves whole blocks
between the paged KV cache and the server: its loads (``vllm_loads``) before the
forward pass that needs them, or in the background (``vllm_async``), and its saves
(``vllm_saves``) after the forward pass.

Workers load the chunks the scheduler's lookup found, keyed in their own namespace (it
includes the TP/PP rank), so every rank loads only its own bytes.
"""

from __future__ import annotations

import os
import threading
import time

import torch
from vllm.logger import init_logger

from kvstore.clock import Clock, monotonic
from kvstore.sdk import populate

from .vllm_async import AsyncLoads
from .vllm_blocks import BlockLayout
from .vllm_client import BreakerClient
from .vllm_cpus import background_cpus, move_here
from .vllm_loads import LoadJob, Loads, SpecOutcome
from .vllm_meta import KVStoreMeta, KVStoreStats, LoadSpec, SaveSpec, Setup
from .vllm_saves import SaveJob, Saves

log = init_logger("vllm.kvstore.connector")


class KVStoreWorker:
    """Loads and saves of one worker; the ``KVConnectorBase_V1`` worker-side methods."""

    def __init__(self, setup: Setup, client: BreakerClient, *, clock: Clock = monotonic) -> None:
        self.setup, self.client = setup, client
        self._clock = clock
        self.stats = KVStoreStats()
        self.layout: BlockLayout | None = None
        self.loads: Loads | None = None
        self.background: AsyncLoads | None = None
        self.saves: Saves | None = None
        self.group_saves: list[Saves] = []  # a hybrid model's: one per KV-cache group
        self._failed: set[int] = set()
        self._failed_reqs: set[str] = set()  # hybrid: loads with a failed block (whole)
        self._orphans: set[str] = set()  # async loads this worker cannot run: reported
        self._busy_warned: float | None = None
        self._late_warned: float | None = None
        self._prefault_stop = threading.Event()
        # The step's load while its layers land beside the forward pass: (job, specs,
        # start time, seconds before the forward pass could start)
        self._job: tuple[LoadJob, list[LoadSpec], float, float] | None = None
        self._layer_at: dict[str, int] = {}  # a layer's place in the payload (its part)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        s = self.setup
        # A hybrid model's groups each have their own block table over layers that share
        # memory with the other groups' (a block id belongs to one group at a time): each
        # group's blocks are moved with a layout of its own layers only.
        layouts = [
            BlockLayout({name: kv_caches[name] for name in g.layers}) for g in s.groups
        ] if s.hybrid else []  # fmt: skip
        self.layout = layout = layouts[0] if layouts else BlockLayout(kv_caches)
        self._layer_at = {name: i for i, name in enumerate(layout.names)}
        mode = s.cfg.save_mode
        if mode == "auto":
            gpu = layout.device.type == "cuda"
            mode = "async" if gpu and s.producer and s.consumer else "sync"
        b = s.ns.base
        cpus = background_cpus(s.cfg.background_cpus, b.tp_size * b.pp_size)
        if s.cfg.prefault_kv_cache and layout.device.type == "cpu":
            threading.Thread(
                target=prefault_kv_cache,
                args=(kv_caches, cpus, self._prefault_stop),
                name="kvstore-prefault-kv",
                daemon=True,
            ).start()
        if s.consumer:
            self.loads = Loads(s, layout, self.client, layouts, cpus=cpus)
            # Its own client: a failure on the loader thread must not close the one the
            # engine thread loads and saves with.
            # Its helper copies on this thread's cores (the compute ones) while the loader
            # runs on the spare ones: where each would not copy beside the other.
            here = frozenset(os.sched_getaffinity(0)) if cpus else None
            self.background = AsyncLoads(
                Loads(s, layout, self.client.sibling("loader"), layouts, cpus=here),
                s.cfg.load_deadline_ms / 1000,
                clock=self._clock,
                cpus=cpus,
                # Loads go to the background unless load_mode is sync (a hybrid model's
                # always do): only then is the loader's client worth its connection.
                connect=s.cfg.load_mode != "sync" or s.hybrid,
            )
        if s.producer:
            for g, group_layout in enumerate(layouts or [layout]):
                gs = s.for_group(g)
                self.group_saves.append(
                    Saves(
                        group_layout,
                        self.client,
                        gs.ns,
                        s.block_size,
                        s.chunk_tokens,
                        background=mode == "async",
                        save_buffer_bytes=s.cfg.save_buffer_bytes,
                        window=gs.window,
                        cpus=cpus,
                    )
                )
            self.saves = self.group_saves[0]
        log.info(
            "kvstore: %d layers, %d blocks of %d bytes, %s saves, namespace %s%s",
            sum(lo.layers for lo in layouts) if layouts else layout.layers,
            layout.num_blocks,
            layout.block_bytes,
            mode,
            s.ns.describe(),
            f", {len(layouts)} KV-cache groups (windows {[g.window for g in s.groups]})"
            if layouts
            else "",
        )

    # -- loads -------------------------------------------------------------------------
    def start_load_kv(self, meta: object) -> None:
        if isinstance(meta, KVStoreMeta) and self.background is not None:
            # Read by the loader thread between chunks: whether this step computes.
            self.background.loads.busy = meta.computing > 0
        if not isinstance(meta, KVStoreMeta) or not meta.loads:
            return
        now = [spec for spec in meta.loads if spec.in_step]
        if now:
            self.load(now)
        later = [spec for spec in meta.loads if not spec.in_step]
        if later and self.background is not None:
            self.background.submit(later)
            self.stats.add(load_async_requests=len(later))
        elif later:  # not a loading worker: vLLM must still hear of them
            self._failed.update(b for spec in later for b in spec.block_ids)
            self._orphans.update(spec.req_id for spec in later)

    def load(self, specs: list[LoadSpec]) -> None:
        """The step's loads: done before this returns, or (``load_by_layer``) copied layer
        by layer while the forward pass runs, ended by ``_end_load`` once it has; failed
        blocks are reported through ``get_block_ids_with_load_errors``."""
        if self.loads is None:
            self._failed.update(b for spec in specs for b in spec.block_ids)
            return
        t0 = time.perf_counter()
        job = self.loads.start(specs, by_layer=True)
        self._job = (job, specs, t0, time.perf_counter() - t0)
        if job.copy is None:
            self._end_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: wait until the step's load has that layer in place."""
        if self._job is not None:
            at = self._layer_at.get(layer_name)
            if at is not None:
                self._job[0].wait(at)

    def _end_load(self) -> None:
        """End the step's load, if one is under way: after the forward pass (or, with no
        layer by layer copy, at once)."""
        if self._job is None:
            return
        job, specs, t0, started_s = self._job
        self._job = None
        copy = job.copy
        try:
            outs = job.finish()
        except Exception as e:  # a bug: the whole load is recomputed, the engine goes on
            self.client.failed("load", e)
            outs = [SpecOutcome(failed=set(spec.block_ids)) for spec in specs]
        loaded = sum(o.loaded_tokens for o in outs)
        failed = set().union(*(o.failed for o in outs))
        self._failed |= failed
        how, seconds = "", time.perf_counter() - t0
        if copy is not None:
            # The load took from its start to the last layer landed (or to the end of the
            # copies made before the forward pass, if later: they ran beside the layers).
            # What the step paid: the planning and the AcquireMany before the forward
            # pass, and the forward pass's waits for layers; the copy ran beside it.
            seconds = max(started_s, copy.started + copy.copied_s - t0)
            how = f" layer by layer, {(started_s + copy.waited_s) * 1e3:.1f} ms of it in the step"
            self.stats.add(load_s=started_s + copy.waited_s)
        else:
            self.stats.add(load_s=seconds)
        self.stats.add(loaded_tokens=loaded)
        if failed:
            self.stats.add(load_failed_blocks=len(failed))
        if job.unwaited and self.loads is not None and self.loads.by_layer:
            self.loads.by_layer = False
            log.warning(
                "kvstore: the forward pass read a loaded layer without waiting for it (its "
                "attention does not call wait_for_layer_load): the step's loads were "
                "recomputed, and loads now copy every layer before the forward pass"
            )
        self._log_load(loaded, sum(s.end - s.start for s in specs), len(specs), seconds, how)

    def handle_preemptions(self, meta: object) -> None:
        """Preempted requests' blocks are freed at once: stop loads still writing there."""
        if isinstance(meta, KVStoreMeta) and meta.preempted and self.background is not None:
            self.background.preempted(meta.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(sending, receiving): the requests whose asynchronous loads are over, loaded,
        failed or given up at their deadline; their failed blocks go to the next
        ``get_block_ids_with_load_errors``, which vLLM calls right after this."""
        self._end_load()  # the forward pass is over (before wait_for_save when deferred)
        recving, self._orphans = self._orphans, set()
        if self.setup.hybrid:
            self._failed_reqs |= recving
        if self.background is None:
            return None, recving or None
        if not self.background.loads.busy:
            self.background.idle()  # nothing computed: give the loader the GIL a moment
        out = self.background.finished(finished_req_ids)
        if self.setup.hybrid:
            self._failed_reqs |= out.failed_reqs
        for tokens, asked, n, seconds in out.batches:
            self._log_load(tokens, asked, n, seconds, " in the background")
        if out.recving:
            self._failed |= out.failed
            self.stats.add(loaded_tokens=out.loaded_tokens, load_s=out.seconds)
            if out.failed:
                self.stats.add(load_failed_blocks=len(out.failed))
            if out.late:
                self.stats.add(load_late_requests=out.late)
                self._warn_late(out.late)
        return None, (recving | out.recving) or None

    def _log_load(self, tokens: int, asked: int, n: int, seconds: float, how: str = "") -> None:
        log.info(
            "kvstore: loaded %d of %d tokens for %d request(s) in %.1f ms%s",
            tokens,
            asked,
            n,
            seconds * 1e3,
            how,
        )

    def _warn_late(self, n: int) -> None:
        now = self._clock()
        if self._late_warned is None or now - self._late_warned > 5:
            self._late_warned = now
            log.warning(
                "kvstore: %d load(s) not done within load_deadline_ms=%d: vLLM computes "
                "the blocks they had not loaded yet",
                n,
                self.setup.cfg.load_deadline_ms,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._end_load()
        out, self._failed = self._failed, set()
        # vLLM raises on block ids with several KV-cache groups (they are per group there):
        # a hybrid model's failures go per request (take_failed_requests).
        return set() if self.setup.hybrid else out

    def take_failed_requests(self) -> set[str]:
        """Hybrid models: requests reported finished receiving whose load lost a block;
        vLLM recomputes them whole (``failed_recving``)."""
        out, self._failed_reqs = self._failed_reqs, set()
        return out

    # -- saves -------------------------------------------------------------------------
    def bind(self, meta: object) -> None:
        """The step's metadata, before its forward pass: sync saves send their ReserveMany
        now, so that its round trip runs beside the forward pass (``Saves.reserve_ahead``).
        Not when the step loads in place (a failed call would close the client whose
        arena those loads read) nor for async saves (their thread reserves)."""
        if not isinstance(meta, KVStoreMeta) or not meta.saves or self.saves is None:
            return
        if any(spec.in_step for spec in meta.loads):
            return
        for g, saves in enumerate(self.group_saves):
            if saves.saver is None:
                specs = [spec for spec in meta.saves if spec.group == g]
                if specs:
                    try:
                        saves.reserve_ahead(specs)
                    except Exception as e:  # a failed save only costs a future hit
                        self.client.failed("save", e)

    def wait_for_save(self, meta: object) -> None:
        self._end_load()  # the forward pass has run: the layers it used have all landed
        if self.loads is not None:  # the step's forward pass has run: end its leases
            self.loads.release_done()
        if not isinstance(meta, KVStoreMeta) or not meta.saves or self.saves is None:
            return
        t0 = time.perf_counter()
        for g, saves in enumerate(self.group_saves):  # one group unless hybrid
            self._save(saves, [spec for spec in meta.saves if spec.group == g])
        self.stats.add(save_s=time.perf_counter() - t0)

    def _save(self, saves: Saves, specs: list[SaveSpec]) -> None:
        """One group's saves of a step: one ReserveMany, one CommitMany."""
        if not specs:
            return
        jobs: list[SaveJob] = []
        skipped = 0
        try:
            skipped = saves.start(specs, jobs)
        except Exception as e:  # a failed save only costs a future hit
            self.client.failed("save", e)
        if saves.saver is not None:  # async: the step's chunks, committed together
            saves.saver.end_batch()
        if skipped:
            self.stats.add(save_skipped_chunks=skipped)
            self._warn_busy(skipped)
        stored = saves.store_all(jobs, self.client) if jobs else []
        saved, failed = sum(stored), sum(1 for t in stored if not t)
        if jobs and saves is self.saves:  # tokens of the first group; every group's chunks
            self.stats.add(saved_tokens=saved)
        if jobs:
            self.stats.add(save_failed_chunks=failed)

    def _warn_busy(self, n: int) -> None:
        now = self._clock()
        if self._busy_warned is None or now - self._busy_warned > 5:
            self._busy_warned = now
            log.warning(
                "kvstore: %d chunk save(s) skipped: more than save_buffer=%s of saves are "
                "waiting for the server (it is slower than the engine produces KV)",
                n,
                self.setup.cfg.save_buffer,
            )

    # -- both --------------------------------------------------------------------------
    def get_stats(self) -> KVStoreStats | None:
        """This worker's counters since the last call (None: nothing counted)."""
        errors = self.client.take_errors()
        for saves in self.group_saves:
            if saves.saver is not None:
                saved, failed = saves.saver.take()
                if saves is not self.saves:
                    saved = 0  # tokens count once, by the first group
                if saved or failed:
                    self.stats.add(saved_tokens=saved, save_failed_chunks=failed)
            if saves.writer is not self.client:
                errors += saves.writer.take_errors()
        if self.background is not None:
            errors += self.background.loads.client.take_errors()
        if errors:
            self.stats.add(errors=errors)
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVStoreStats()
        return out

    def shutdown(self) -> None:
        self._prefault_stop.set()
        self._end_load()
        timeout = self.setup.cfg.timeout_ms / 1000
        if self.background is not None:
            self.background.close(timeout)
            self.background.loads.close()
            self.background.loads.client.close()
        if self.loads is not None:
            self.loads.close()
        for saves in self.group_saves:
            saves.close(timeout=self.setup.cfg.timeout_ms / 1000 * 4)
        self.client.close()


def prefault_kv_cache(
    kv_caches: dict[str, torch.Tensor], cpus: frozenset[int] | None, stop: threading.Event
) -> None:
    """Fault in every page of a CPU engine's paged KV cache (on a daemon thread, on the
    spare cores): vLLM allocates it untouched, so the first load into a block never used
    before paid the page faults inside the step (measured: 128 MiB into fresh blocks in
    ~60 ms against ~11 ms once touched). Nothing is written, so blocks vLLM already uses
    meanwhile are safe (``kvstore.sdk.populate``)."""
    move_here(cpus)
    t0 = time.perf_counter()
    seen: dict[int, int] = {}  # layers often share one allocation: each is faulted once
    for t in kv_caches.values():
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    done = all(populate(ptr, n, stop) for ptr, n in seen.items())
    log.debug(
        "kvstore: %s %d MiB of the KV cache in %.0f ms",
        "faulted in" if done else "stopped faulting in (kernel < 5.14, or shutting down)",
        sum(seen.values()) >> 20,
        (time.perf_counter() - t0) * 1e3,
    )
