"""What the connector shows vLLM, and what vLLM's prefix-cache reset does to it.

- KV events (``take_events``, scheduler side): for the chunks the scheduler plans to
  save, ``BlockStored`` events with vLLM's own block hashes (``request.block_hashes``,
  as the KV cache manager publishes them for the same blocks with medium ``GPU``), token
  ids, block size, LoRA, extra keys and the medium ``CPU`` (where a stored chunk lands:
  the server's shared-memory L1, host memory), so KV-aware routers (llm-d, Dynamo) that
  follow vLLM's event stream see what this engine can load. A prefix-cache reset that
  reaches the connector adds ``AllBlocksCleared``. vLLM publishes them only with
  ``--kv-events-config '{"enable_kv_cache_events": true, ...}'``; without it nothing is
  built. The server's own evictions are not announced: it does not tell its clients.
- Prometheus (``build_prom_metrics``, in the process that serves vLLM's ``/metrics``):
  every counter of the connector's stats as a ``vllm:kvstore_*`` counter (``PROM_COUNTERS``),
  labelled like vLLM's own metrics.
- ``reset_cache``: vLLM's ``reset_prefix_cache(reset_connector=True)``, which it calls
  itself on ``pause_generation(clear_cache=True)`` and before every sleep (level 1 or
  2), mostly around weight updates. The model's weights are not in the namespace, so
  KV stored before an update would be loaded after it, computed with the old weights.
  A reset therefore moves this engine to a new key generation (``new_generation``,
  folded into every request's salt): nothing stored before it is ever loaded by this
  engine again, whoever stored it. Nothing is deleted: other engines sharing the server
  may still run the old weights and keep their KV; the old chunks age out (LRU) or go
  with ``kvstore clear``. The generation is random, so two engines that each reset do
  not share KV afterwards (neither can know the other has the same weights) until they
  restart; a restarted engine, with the weights it loads from disk, is back in the
  generation of its first start.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

__all__ = [
    "MEDIUM",
    "PROM_COUNTERS",
    "KVStorePromMetrics",
    "SaveEvents",
    "new_generation",
    "with_generation",
]

MEDIUM = MEDIUM_CPU

# The connector's stats keys (KVStoreStats, summed over workers) -> Prometheus counter name
# and help. A key missing here is not exported (tests/connectors/test_vllm_observe.py
# fails for it).
PROM_COUNTERS: dict[str, tuple[str, str]] = {
    "lookup_hits": ("vllm:kvstore_lookup_hits", "Requests kvstore-server had tokens to load for"),
    "lookup_misses": (
        "vllm:kvstore_lookup_misses",
        "Requests of a loading engine that kvstore-server had nothing to load for",
    ),
    "lookup_s": (
        "vllm:kvstore_lookup_seconds",
        "Seconds the scheduler waited for kvstore-server's answers to its lookups",
    ),
    "hit_tokens": ("vllm:kvstore_hit_tokens", "Tokens scheduled to be loaded from kvstore-server"),
    "loaded_tokens": (
        "vllm:kvstore_loaded_tokens",
        "Tokens loaded into the KV cache from kvstore-server (summed over TP/PP ranks)",
    ),
    "load_s": ("vllm:kvstore_load_seconds", "Seconds workers spent loading from kvstore-server"),
    "load_async_requests": (
        "vllm:kvstore_load_async_requests",
        "Requests whose load ran in the background (WAITING_FOR_REMOTE_KVS)",
    ),
    "load_late_requests": (
        "vllm:kvstore_load_late_requests",
        "Background loads that missed load_deadline_ms (their blocks were recomputed)",
    ),
    "load_failed_blocks": (
        "vllm:kvstore_load_failed_blocks",
        "Blocks that were to be loaded from kvstore-server but were not (recomputed)",
    ),
    "saved_tokens": ("vllm:kvstore_saved_tokens", "Tokens written to kvstore-server"),
    "save_s": ("vllm:kvstore_save_seconds", "Seconds the engine's thread spent on saves"),
    "save_skipped_chunks": (
        "vllm:kvstore_save_skipped_chunks",
        "Chunks not saved because save_buffer was full (async saves)",
    ),
    "save_failed_chunks": (
        "vllm:kvstore_save_failed_chunks",
        "Chunk saves that failed (async saves)",
    ),
    "errors": (
        "vllm:kvstore_errors",
        "Calls to kvstore-server that raised something other than a connection failure",
    ),
}


def new_generation() -> str:
    """A key generation no engine has used: 64 random bits."""
    return os.urandom(8).hex()


def with_generation(salt: str, generation: str) -> str:
    """A request's salt in this engine's key generation ("" = the first, unchanged)."""
    if not generation:
        return salt
    return f"{salt}|gen:{generation}" if salt else f"gen:{generation}"


class SaveEvents:
    """``BlockStored`` events for the saves the scheduler plans, taken by ``take_events``.

    Announced when planned: on CPU and for ``kv_producer`` (sync saves) the chunks are
    stored before the step's output reaches the scheduler, which is when vLLM takes the
    events; an async save may still be on its way, and a save that fails or is skipped
    is not taken back (a router that trusts it costs one miss: the load computes)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Requests by id, weakly: vLLM owns them, and one finished without a
        # request_finished must not be kept alive here.
        self._reqs: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._events: list[KVCacheEvent] = []
        self._fields = set(getattr(BlockStored, "__struct_fields__", ()))

    @classmethod
    def of(cls, vllm_config: Any, block_size: int) -> SaveEvents | None:
        """Events for an engine that publishes them; None (nothing built) otherwise."""
        ec = getattr(vllm_config, "kv_events_config", None)
        return cls(block_size) if ec is not None and ec.enable_kv_cache_events else None

    def track(self, request: Any) -> None:
        self._reqs[request.request_id] = request

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def planned(self, req_id: str, start: int, end: int) -> None:
        """The scheduler planned to save tokens [start, end) of the request (whole blocks)."""
        request = self._reqs.get(req_id)
        if request is None:
            return
        bs = self.block_size
        first, last = start // bs, end // bs
        hashes = list(getattr(request, "block_hashes", ()) or ())[first:last]
        if not hashes:
            return  # vLLM hashes blocks only with prefix caching on: nothing to name them by
        last = first + len(hashes)
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        lora = getattr(request, "lora_request", None)
        fields: dict[str, Any] = dict(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes],
            parent_block_hash=(
                maybe_convert_block_hash(request.block_hashes[first - 1]) if first else None
            ),
            token_ids=list(request.all_token_ids[first * bs : last * bs]),
            block_size=bs,
            lora_id=getattr(lora, "adapter_id", None) if lora is not None else None,
            medium=MEDIUM,
            lora_name=getattr(lora, "name", None) if lora is not None else None,
            extra_keys=self._extra_keys(request, first, last),
            group_idx=0,
            session_id=getattr(request, "session_id", None),
        )
        # Fields a newer or older BlockStored lacks are left out rather than refused.
        self._events.append(BlockStored(**{k: v for k, v in fields.items() if k in self._fields}))

    def _extra_keys(self, request: Any, first: int, last: int) -> list[Any] | None:
        """Each block's extra keys (LoRA, multimodal items, cache salt) as the KV cache
        manager publishes them, so a router hashing them gets the same answer."""
        try:
            from vllm.v1.core.kv_cache_utils import (
                generate_block_hash_extra_keys,
                to_event_extra_keys,
            )
        except ImportError:  # a vLLM without them: events without extra keys
            return None
        bs, keys, mm = self.block_size, [], 0
        for b in range(first, last):
            k, mm = generate_block_hash_extra_keys(request, b * bs, (b + 1) * bs, mm)
            keys.append(k)
        out: list[Any] | None = to_event_extra_keys(keys)
        return out

    def cleared(self) -> None:
        """A reset: nothing this engine stored before can be loaded by it any more."""
        self._events.append(AllBlocksCleared())

    def take(self) -> Iterable[KVCacheEvent]:
        out, self._events = self._events, []
        return out


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The connector's counters in vLLM's Prometheus registry, one counter per stats key."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in PROM_COUNTERS.items()
        }
        self._bound: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in (transfer_stats_data or {}).items():
            counter = self._counters.get(key)
            if counter is None or not isinstance(value, int | float) or value <= 0:
                continue
            bound = self._bound.get((engine_idx, key))
            if bound is None:
                labels = self.per_engine_labelvalues[engine_idx]
                bound = self._bound[(engine_idx, key)] = counter.labels(*labels)
            bound.inc(value)
