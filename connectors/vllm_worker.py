"""The worker half of the connector, in each vLLM worker process: it moves whole blocks
between the paged KV cache and the server, its loads (``vllm_loads``) before the
forward pass and its saves (``vllm_saves``) after it.

Workers compute keys with their own namespace (it includes the TP/PP rank) and
look up their own chunks, so every rank loads only its own bytes.
"""

from __future__ import annotations

import time

import torch
from kvstore.connectors.vllm_blocks import BlockLayout
from kvstore.connectors.vllm_client import BreakerClient
from kvstore.connectors.vllm_loads import Loads
from kvstore.connectors.vllm_meta import KVStoreMeta, KVStoreStats, LoadSpec, Setup
from kvstore.connectors.vllm_saves import SaveJob, Saves
from vllm.logger import init_logger

from kvstore.clock import Clock, monotonic
from kvstore.keys import ChunkKey

log = init_logger("vllm.kvstore.connector")


class KVStoreWorker:
    """Loads and saves of one worker; the ``KVConnectorBase_V1`` worker-side methods."""

    def __init__(self, setup: Setup, client: BreakerClient, *, clock: Clock = monotonic) -> None:
        self.setup, self.client = setup, client
        self._clock = clock
        self.stats = KVStoreStats()
        self.layout: BlockLayout | None = None
        self.loads: Loads | None = None
        self.saves: Saves | None = None
        self._failed: set[int] = set()
        self._busy_warned: float | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        s = self.setup
        self.layout = layout = BlockLayout(kv_caches)
        mode = s.cfg.save_mode
        if mode == "auto":
            gpu = layout.device.type == "cuda"
            mode = "async" if gpu and s.producer and s.consumer else "sync"
        self.loads = Loads(s, layout, self.client)
        if s.producer:
            self.saves = Saves(
                layout,
                self.client,
                s.ns,
                s.block_size,
                s.chunk_tokens,
                background=mode == "async",
                save_buffer_bytes=s.cfg.save_buffer_bytes,
            )
        log.info(
            "kvstore: %d layers, %d blocks of %d bytes, %s saves, namespace %s",
            layout.layers,
            layout.num_blocks,
            layout.block_bytes,
            mode,
            s.ns.describe(),
        )

    # -- loads -------------------------------------------------------------------------
    def start_load_kv(self, meta: object) -> None:
        if isinstance(meta, KVStoreMeta) and meta.loads:
            self.load(meta.loads)

    def load(self, specs: list[LoadSpec]) -> None:
        """The step's loads, done before this returns; failed blocks are reported through
        ``get_block_ids_with_load_errors``."""
        if self.loads is None:
            return
        t0 = time.perf_counter()
        out = self.loads.load(specs)
        seconds = time.perf_counter() - t0
        self._failed |= out.failed
        self.stats.add(loaded_tokens=out.loaded_tokens, load_s=seconds)
        if out.failed:
            self.stats.add(load_failed_blocks=len(out.failed))
        log.info(
            "kvstore: loaded %d of %d tokens for %d request(s) in %.1f ms",
            out.loaded_tokens,
            sum(s.end - s.start for s in specs),
            len(specs),
            seconds * 1e3,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed = self._failed, set()
        return out

    # -- saves -------------------------------------------------------------------------
    def wait_for_save(self, meta: object) -> None:
        saves = self.saves
        if not isinstance(meta, KVStoreMeta) or not meta.saves or saves is None:
            return
        t0 = time.perf_counter()
        jobs: list[SaveJob] = []
        seen: set[ChunkKey] = set()  # requests sharing a prefix complete its chunks together
        skipped = 0
        for spec in meta.saves:
            try:
                skipped += saves.start(spec, seen, jobs)
            except Exception as e:  # a failed save only costs a future hit
                self.client.failed("save", e)
        if skipped:
            self.stats.add(save_skipped_chunks=skipped)
            self._warn_busy(skipped)
        stored = saves.store_all(jobs, self.client) if jobs else []
        saved, failed = sum(stored), sum(1 for t in stored if not t)
        if jobs:
            self.stats.add(saved_tokens=saved, save_failed_chunks=failed)
        self.stats.add(save_s=time.perf_counter() - t0)

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
        saves = self.saves
        saver = saves.saver if saves is not None else None
        if saver is not None:
            saved, failed = saver.take()
            if saved or failed:
                self.stats.add(saved_tokens=saved, save_failed_chunks=failed)
        errors = self.client.take_errors()
        if saves is not None and saves.writer is not self.client:
            errors += saves.writer.take_errors()
        if errors:
            self.stats.add(errors=errors)
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVStoreStats()
        return out

    def shutdown(self) -> None:
        if self.saves is not None:
            self.saves.close(timeout=self.setup.cfg.timeout_ms / 1000 * 4)
        self.client.close()
