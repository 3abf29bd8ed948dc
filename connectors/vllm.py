"""KVStoreConnector: vLLM's KV connector (KVConnectorBase_V1) backed by kvstore-server.

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": "unix:///run/kvstore.sock"}}'

Two halves in two processes. The scheduler half answers
``get_num_new_matched_tokens`` with one Lookup RPC under a short deadline and
plans, per step, which blocks to load and which chunks became complete and are
to be saved. The worker half moves whole blocks between the paged KV cache and
the server: through the server's shared-memory arena on the same host, over
gRPC otherwise.

Choices, and why:
- Loads are synchronous and bounded (``start_load_kv`` before the forward, every
  call with a deadline). Same-host loads run at memory speed, so the async path's
  extra scheduler step would cost more TTFT than it hides; a load that fails or
  times out is reported through ``get_block_ids_with_load_errors`` and vLLM
  recomputes those blocks (with ``kv_load_failure_policy: recompute``).
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
- Workers compute keys with their own namespace (it includes the TP/PP rank) and
  look up their own chunks, so every rank loads only its own bytes.
- A server that fails is skipped for ``retry_after_ms`` and tried again: the
  engine keeps serving, it just computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from kvstore.connectors.vllm_blocks import BlockLayout
from kvstore.connectors.vllm_config import ConnectorConfig
from kvstore.connectors.vllm_runtime import Backend, engine_namespace
from kvstore.connectors.vllm_saves import SaveJob, Saves, SaveSpec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

from kvstore.keys import ChunkKey, tokens_to_bytes

# Under "vllm.": vLLM configures only its own logger tree, so our lines land in its log.
log = init_logger("vllm.kvstore.connector")


_ASK_TTL_S = 1.0  # how long a lookup answer is reused for a request that keeps waiting


@dataclass
class LoadSpec:
    req_id: str
    tokens: list[int]  # the prompt up to the end of the block holding token ``end - 1``
    salt: str  # per-request part of the namespace (cache_salt, LoRA)
    start: int  # first token to load (block aligned; earlier ones are computed locally)
    end: int  # one past the last token vLLM counts as loaded (may end inside a block)
    block_ids: list[int]  # the cache blocks for tokens [start, end), the last one whole


@dataclass
class KVStoreMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class KVStoreStats(KVConnectorStats):
    """Counters that vLLM aggregates across workers and logs (hits, tokens, seconds)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not self.data

    def add(self, **kw: float) -> None:
        for k, v in kw.items():
            self.data[k] = self.data.get(k, 0) + v


@dataclass
class _Req:
    """Scheduler-side state of one running request."""

    tokens: list[int]
    salt: str
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # tokens of the prompt already saved or planned (chunk aligned)
    load: tuple[int, int] | None = None  # (start, end) tokens to load in the next step


def _request_salt(request: Any) -> str:
    parts = [getattr(request, "cache_salt", None) or ""]
    # Multimodal placeholders are the same tokens for different images: the items'
    # hashes must be part of the key, or one image's KV would serve another.
    mm = [str(getattr(f, "identifier", "")) for f in getattr(request, "mm_features", None) or ()]
    if mm:
        parts.append("mm:" + ",".join(mm))
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora:{getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}")
    return "|".join(p for p in parts if p)


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.cfg = ConnectorConfig.parse(tc.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.producer = tc.kv_role in ("kv_producer", "kv_both") and self.cfg.save
        self.consumer = tc.kv_role in ("kv_consumer", "kv_both") and self.cfg.load
        self.base_ns = engine_namespace(
            vllm_config, kv_cache_config, self.cfg.salt, worker=role == KVConnectorRole.WORKER
        )
        self.backend = Backend(
            self.cfg,
            engine_id=str(tc.engine_id),
            role=self.role_name,
            engine=engine_namespace(vllm_config, kv_cache_config, self.cfg.salt, worker=False),
        )
        self.chunk_tokens = self.backend.chunk_tokens(self.block_size)
        self.stats = KVStoreStats()
        if getattr(tc, "kv_load_failure_policy", "recompute") == "fail" and self.consumer:
            log.warning(
                "kvstore: kv_load_failure_policy is 'fail': a failed load aborts the "
                "request; set it to 'recompute' so vLLM recomputes instead"
            )
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._hits: dict[str, tuple[int, int]] = {}
        self._asked: dict[str, tuple[float, int]] = {}  # req_id -> (when, matched tokens)
        # worker side
        self._layout: BlockLayout | None = None
        self._failed: set[int] = set()
        self._saves: Saves | None = None
        self._busy_warned = 0.0

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        if not self.consumer or not tokens:
            return 0, False
        # A hit must leave one token to compute (vLLM asserts it): a prompt stored to its
        # last whole block loads that block too and reports one token less, so vLLM
        # computes one token, not a block (it rewrites that token's KV with the same values).
        limit = request.num_tokens - 1
        if limit <= num_computed_tokens:
            return 0, False
        # A request that cannot be scheduled yet is asked again every step: reuse a
        # fresh answer instead of one RPC per step.
        now = time.monotonic()
        cached = self._asked.get(request.request_id)
        if cached is not None and now - cached[0] < _ASK_TTL_S:
            matched = cached[1]
        else:
            ns = self.base_ns.for_request(_request_salt(request))
            result = self.backend.lookup(
                ns, tokens, min_tokens=self.cfg.min_tokens, granularity=self.block_size
            )
            matched = min(result.matched_tokens if result else 0, limit)
            self._asked[request.request_id] = (now, matched)
        if matched <= num_computed_tokens:
            return 0, False
        self._hits[request.request_id] = (num_computed_tokens, matched)
        return matched - num_computed_tokens, False

    def _blocks(self, tokens: int) -> int:
        """Blocks holding tokens [0, tokens): the last one may hold later tokens too."""
        return -(-tokens // self.block_size)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tokens = list(request.prompt_token_ids or [])
        r = self._reqs.get(request.request_id)
        if r is None:
            r = self._reqs[request.request_id] = _Req(tokens, _request_salt(request))
        hit = self._hits.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        if num_external_tokens > 0 and hit is not None:
            start = hit[0]
            r.load = (start, start + num_external_tokens)
            # Exact chunks that were loaded need no save; a partial one does (new key). A
            # hit one token short of the prompt's end loaded its last block whole.
            loaded = self._blocks(start + num_external_tokens) * self.block_size
            r.saved = max(r.saved, loaded // self.chunk_tokens * self.chunk_tokens)
            self.stats.add(lookup_hits=1, hit_tokens=num_external_tokens)
        elif self.consumer:
            self.stats.add(lookup_misses=1)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KVStoreMeta()
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if rid not in resumed:  # its blocks are gone; it comes back through a new lookup
                self._reqs.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            r = self._reqs.get(new.req_id)
            if r is not None:
                r.block_ids = list(new.block_ids[0])
                self._plan(meta, new.req_id, r, new.num_computed_tokens, scheduler_output)
        for i, rid in enumerate(cached.req_ids):
            r = self._reqs.get(rid)
            if r is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in resumed:
                r.block_ids = list(nb[0]) if nb else []  # resumed: the full block table
            elif nb:
                r.block_ids.extend(nb[0])  # running: appended blocks only
            self._plan(meta, rid, r, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _plan(self, meta: KVStoreMeta, rid: str, r: _Req, computed: int, so: Any) -> None:
        bs = self.block_size
        if r.load is not None:
            start, end = r.load
            whole = self._blocks(end)
            blocks = r.block_ids[start // bs : whole]
            meta.loads.append(LoadSpec(rid, r.tokens[: whole * bs], r.salt, start, end, blocks))
            r.load = None
        if not self.producer:
            return
        done = min(computed + so.num_scheduled_tokens.get(rid, 0), len(r.tokens))
        # Whole chunks completed so far, and at the end of the prefill its last whole blocks.
        upto = done // self.chunk_tokens * self.chunk_tokens
        if done == len(r.tokens):
            upto = done // bs * bs
        if upto > r.saved and len(r.block_ids) * bs >= upto:
            meta.saves.append(
                SaveSpec(rid, r.tokens[:upto], r.salt, r.saved, r.block_ids[: upto // bs])
            )
            r.saved = upto

    def update_connector_output(self, connector_output: Any) -> None:
        """A load failed (vLLM recomputes those blocks): save them again once computed."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not invalid:
            return
        for r in self._reqs.values():
            bad = [i for i, b in enumerate(r.block_ids) if b in invalid]
            if bad:
                first = bad[0] * self.block_size
                r.saved = min(r.saved, first // self.chunk_tokens * self.chunk_tokens)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        return False, None  # saves finish inside their step: the blocks may be freed now

    def get_kv_connector_stats(self) -> KVStoreStats | None:
        saver = self._saves.saver if self._saves is not None else None
        if saver is not None:
            saved, failed = saver.take()
            if saved or failed:
                self.stats.add(saved_tokens=saved, save_failed_chunks=failed)
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVStoreStats()
        return out

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVStoreStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._saves is not None:
            self._saves.close(timeout=self.cfg.timeout_ms / 1000 * 4)
        self.backend.close()

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layout = BlockLayout(kv_caches)
        mode = self.cfg.save_mode
        if mode == "auto":
            gpu = self._layout.device.type == "cuda"
            mode = "async" if gpu and self.producer and self.consumer else "sync"
        if self.producer:
            self._saves = Saves(
                self._layout,
                self.backend,
                self.base_ns,
                self.block_size,
                self.chunk_tokens,
                background=mode == "async",
                save_buffer_bytes=self.cfg.save_buffer_bytes,
            )
        log.info(
            "kvstore: %d layers, %d blocks of %d bytes, %s saves, namespace %s",
            self._layout.layers,
            self._layout.num_blocks,
            self._layout.block_bytes,
            mode,
            self.base_ns.describe(),
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreMeta) or not meta.loads or self._layout is None:
            return
        t0 = time.perf_counter()
        loaded = 0
        for spec in meta.loads:
            try:  # an exception here would kill the engine: report failed blocks instead
                loaded += self._load(spec)
            except Exception as e:
                self.backend.failed("load", e)
                self._failed.update(spec.block_ids)
        seconds = time.perf_counter() - t0
        self.stats.add(loaded_tokens=loaded, load_s=seconds)
        wanted = sum(s.end - s.start for s in meta.loads)
        log.info(
            "kvstore: loaded %d of %d tokens for %d request(s) in %.1f ms",
            loaded,
            wanted,
            len(meta.loads),
            seconds * 1e3,
        )

    def _load(self, spec: LoadSpec) -> int:
        assert self._layout is not None
        bs, layout = self.block_size, self._layout
        ns = self.base_ns.for_request(spec.salt)
        result = self.backend.lookup(ns, spec.tokens, granularity=bs, worker=True)
        whole = self._blocks(spec.end)
        todo = dict(zip(range(spec.start // bs, whole), spec.block_ids, strict=True))
        for match in result.chunks if result else ():
            first = match.start // bs
            blocks = [b for b in range(first, first + match.tokens // bs) if b in todo]
            if not blocks:
                continue
            stored = match.stored_tokens // bs
            buf = layout.host_buffer(layout.nbytes(stored))
            header = self.backend.get_into(match.key, buf)
            if header is None or header.raw_size != buf.numel():
                continue  # gone or another layout: those blocks are reported below
            want = tokens_to_bytes(spec.tokens[match.start : match.start + match.tokens])
            if header.token_bytes[: len(want)] != want:
                # A partial match rests on 8-byte sub-hashes; the record's own token ids
                # have the last word, so colliding tokens are recomputed, never loaded.
                continue
            # Blocks of the chunk before spec.start are computed locally: only ``blocks`` move.
            layout.scatter(buf, stored, [todo.pop(b) for b in blocks], first=blocks[0] - first)
        if todo:
            self._failed.update(todo.values())
            self.stats.add(load_failed_blocks=len(todo))
        missed = sum(min((b + 1) * bs, spec.end) - max(b * bs, spec.start) for b in todo)
        return (spec.end - spec.start) - missed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saved in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        saves = self._saves
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
                self.backend.failed("save", e)
        if skipped:
            self.stats.add(save_skipped_chunks=skipped)
            self._warn_busy(skipped)
        stored = saves.store_all(jobs, self.backend) if jobs else []
        saved, failed = sum(stored), sum(1 for t in stored if not t)
        if jobs:
            self.stats.add(saved_tokens=saved, save_failed_chunks=failed)
        self.stats.add(save_s=time.perf_counter() - t0)

    def _warn_busy(self, n: int) -> None:
        now = time.monotonic()
        if now - self._busy_warned > 5:
            self._busy_warned = now
            log.warning(
                "kvstore: %d chunk save(s) skipped: more than save_buffer=%s of saves are "
                "waiting for the server (it is slower than the engine produces KV)",
                n,
                self.cfg.save_buffer,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed = self._failed, set()
        return out
