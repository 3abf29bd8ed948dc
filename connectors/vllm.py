"""KVStoreConnector: vLLM's KV connector (KVConnectorBase_V1) backed by kvstore-server.

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": "unix:///run/kvstore.sock"}}'

vLLM builds the connector twice, in two processes: with the scheduler role in the
engine core, with the worker role in every worker. This class is a facade, as
vLLM's own ``OffloadingConnector`` is: by role it builds one half and forwards each
``KVConnectorBase_V1`` method to it.

- ``vllm_scheduler.KVStoreScheduler``: answers ``get_num_new_matched_tokens`` with one
  Lookup RPC under a short deadline and plans, per step, which blocks to load and
  which chunks became complete and are to be saved (``vllm_meta.KVStoreMeta``).
- ``vllm_worker.KVStoreWorker``: moves whole blocks between the paged KV cache and the
  server (its loads in ``vllm_loads``, its saves in ``vllm_saves``, the block copies
  in ``vllm_blocks``): through the server's shared-memory arena on the same host,
  over gRPC otherwise.
- each half talks to the server through its own ``vllm_client.BreakerClient``: a
  server that cannot be reached is skipped for ``retry_after_ms`` (the engine keeps
  serving, it just computes); any other failure is logged, counted in ``errors``, and
  costs only the request it happened in. Without a url, the client opens the
  engine's private server (``vllm_private``).
- ``vllm_observe``: what vLLM shows of the connector (``take_events``: BlockStored for
  planned saves with vLLM's block hashes; ``build_prom_metrics``: the stats as
  ``vllm:kvstore_*`` counters) and ``reset_cache`` (a new key generation, nothing deleted).

Choices, and why:
- A step's loads cost a constant number of calls: the workers load the chunks the
  scheduler's lookup found (no second lookup), every chunk of the step under one
  AcquireMany, the leases ended by one Release nobody waits for; on CPU each payload
  goes from the arena's pages into its cache blocks in one verified pass.
- Hits in the server's L1 on this host load synchronously (``start_load_kv`` before
  the forward: a copy at memory speed); hits below L1 or on another host load
  asynchronously (``load_async=True``: the request waits in WAITING_FOR_REMOTE_KVS
  while a worker thread loads it, and ``get_finished`` reports it), the server
  promoting the chunks into L1 meanwhile. Every load has a deadline; a load that
  fails, times out or passes ``load_deadline_ms`` is reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes those blocks (with
  ``kv_load_failure_policy: recompute``).
- Saves start in ``wait_for_save``, after every layer of the step is written, from
  the tokens each request has computed so far (``num_computed_tokens +
  num_scheduled_tokens``), per request and per whole chunk: never by slicing the
  flat batch (the seed's in-flight batching bug). The blocks are copied out inside
  the step (on CUDA, on a side stream that the compute stream waits for before it
  can overwrite them), so a preempted request's freed blocks are never read later.
  Storing the copies is ``save_mode``: in the step (sync), or by a background
  thread (async, the default for kv_both on a GPU: the next forward pass starts
  while the device-to-host copy and the put run). A P/D producer stores in the
  step, so the chunks are on the server before its answer reaches the proxy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from kvstore.errors import KVStoreError

from .vllm_client import open_client
from .vllm_config import ConnectorConfig
from .vllm_cpus import background_cpus
from .vllm_meta import KVStoreMeta, KVStoreStats, LoadSpec, SaveSpec, Setup
from .vllm_namespace import engine_groups, engine_namespace
from .vllm_observe import KVStorePromMetrics, SaveEvents, new_generation
from .vllm_scheduler import KVStoreScheduler
from .vllm_worker import KVStoreWorker

__all__ = ["KVStoreConnector", "KVStoreMeta", "KVStoreStats", "LoadSpec", "SaveSpec"]

# Under "vllm.": vLLM configures only its own logger tree, so our lines land in its log.
log = init_logger("vllm.kvstore.connector")


class WrongRole(KVStoreError):
    """vLLM called a method of one half on the connector built as the other half."""


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """``SupportsHMA``: vLLM keeps its hybrid memory allocator on, so a model with
    sliding-window and full-attention layers gets a KV-cache group per kind (and a
    sliding window's blocks outside it are freed); each group is stored under keys of
    its own, a sliding-window group only within its window (docs/vllm.md)."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        cfg = ConnectorConfig.parse(tc.kv_connector_extra_config)
        worker = role == KVConnectorRole.WORKER
        name = "worker" if worker else "scheduler"
        engine = engine_namespace(vllm_config, kv_cache_config, cfg.salt, worker=False)
        # A CPU worker is bound to its compute cores, and a private server it starts would
        # inherit them: it goes where the connector's own threads go (KVStoreWorker).
        ranks = engine.base.tp_size * engine.base.pp_size
        client = open_client(
            cfg,
            engine_id=str(tc.engine_id),
            role=name,
            engine=engine,
            cpus=background_cpus(cfg.background_cpus, ranks) if worker else None,
        )
        block_size = vllm_config.cache_config.block_size
        groups = engine_groups(kv_cache_config)
        ns = engine_namespace(vllm_config, kv_cache_config, cfg.salt, worker=worker)
        setup = Setup(
            cfg=cfg,
            ns=ns,
            block_size=block_size,
            chunk_tokens=client.chunk_tokens(block_size),
            # A TP rank that shares rank 0's copy (MLA) loads it but never stores it.
            producer=tc.kv_role in ("kv_producer", "kv_both") and cfg.save and ns.writer,
            consumer=tc.kv_role in ("kv_consumer", "kv_both") and cfg.load,
            groups=groups,
            # one sliding-window group (every layer windowed): its records hold a window
            window=groups[0].window if len(groups) == 1 else 0,
        )
        if getattr(tc, "kv_load_failure_policy", "recompute") == "fail" and setup.consumer:
            log.warning(
                "kvstore: kv_load_failure_policy is 'fail': a failed load aborts the "
                "request; set it to 'recompute' so vLLM recomputes instead"
            )
        self.connector_scheduler: KVStoreScheduler | None = None
        self.connector_worker: KVStoreWorker | None = None
        self._events: SaveEvents | None = None  # KV events (vllm_observe), scheduler side
        if worker:
            self.connector_worker = KVStoreWorker(setup, client)
        else:
            self.connector_scheduler = KVStoreScheduler(setup, client)
            self._events = SaveEvents.of(vllm_config, block_size)
            if self._events is not None:
                self.connector_scheduler.on_save = self._events.planned

    @property
    def scheduler(self) -> KVStoreScheduler:
        if self.connector_scheduler is None:
            raise WrongRole("a scheduler-side method was called on the worker's connector")
        return self.connector_scheduler

    @property
    def worker(self) -> KVStoreWorker:
        if self.connector_worker is None:
            raise WrongRole("a worker-side method was called on the scheduler's connector")
        return self.connector_worker

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._events is not None:
            self._events.track(request)
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._events is not None:
            self._events.forget(request.request_id)
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``'s ``request_finished``: every group's blocks, freed as soon as
        this returns (saves finish inside their step)."""
        if self._events is not None:
            self._events.forget(request.request_id)
        return self.scheduler.request_finished(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._events.take() if self._events is not None else ()

    def reset_cache(self) -> bool | None:
        """vLLM's prefix-cache reset: a new key generation, nothing deleted (vllm_observe)."""
        if self.connector_scheduler is None:
            return None
        generation = new_generation()
        self.connector_scheduler.reset_cache(generation)
        if self._events is not None:
            self._events.cleared()
        log.info("kvstore: prefix cache reset; KV stored before it is not loaded again")
        return True

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``, and for a hybrid model the loads that lost a block as
        ``failed_recving``: vLLM refuses block ids with several KV-cache groups."""
        sending, recving = self.worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self.worker.take_failed_requests(),
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # ----------------------------------------------------------------------- both
    def get_kv_connector_stats(self) -> KVStoreStats | None:
        if self.connector_worker is not None:
            return self.connector_worker.get_stats()
        return self.scheduler.get_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVStoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks before it starts an engine with sleep mode on (0.32 never does).
        kvstore registers no device memory with anyone (``cudaHostRegister`` pins only the
        server's host arena), and its copies out of the KV cache are device work that vLLM
        waits for (it synchronizes the device before it sleeps), so the cache's remap at
        sleep leaves nothing stale here: 0.33's ``unregister_kv_caches`` and
        ``restore_kv_caches`` have nothing to do."""
        return True

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
