"""The scheduler half of the connector, in vLLM's engine-core process.

It answers ``get_num_new_matched_tokens`` with one Lookup RPC under a short
deadline (``lookup_timeout_ms``: it must never stall scheduling), and plans per
step which blocks the workers load and which chunks became complete and are to
be saved (``KVStoreMeta``, pickled to the workers).

What the lookup found (each chunk's key, stored size and tier) goes to the workers
with the load, so they do not look up again. Where the hit is decides how it is
loaded (``load_mode: auto``): all in the server's L1 on this host, synchronously in
the step that computes the rest of the prompt (a copy at memory speed); otherwise
(on disk, in Redis/Valkey, a server on another host) asynchronously: the lookup
asks the server to promote the chunks into L1 (``prefetch``), vLLM is told
``load_async=True``, and the request waits in ``WAITING_FOR_REMOTE_KVS`` while the
workers load it in the background and the other requests run.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.logger import init_logger

from kvstore.clock import Clock, monotonic
from kvstore.sdk import LentLease
from kvstore.types import ChunkMatch, TierLevel

from .vllm_client import BreakerClient
from .vllm_config import RequestParams, request_params
from .vllm_meta import (
    ChunkRef,
    GroupLoad,
    KVStoreMeta,
    KVStoreStats,
    LoadSpec,
    SaveSpec,
    Setup,
    whole_chunks,
)
from .vllm_observe import with_generation

_ASK_TTL_S = 1.0  # how long a lookup answer is reused for a request that keeps waiting
# Lent by the lookup only up to this many chunks past vLLM's computed tokens (16k tokens
# of 256). Lending costs the server ~15 us a chunk, now in the scheduler's step where an
# AcquireMany's cost was the loader's (a lookup of 16 chunks 0.27 ms, lending them too
# 0.58 ms; 64: 0.45 and 1.47 ms): a longer hit has its leases acquired by the worker,
# whose one round trip is little beside its load.
_LEND_CHUNKS = 64

log = init_logger("vllm.kvstore.connector")


@dataclass
class _Req:
    """Scheduler-side state of one running request."""

    tokens: list[int]
    salt: str
    asks: RequestParams  # its kv_transfer_params (drop_after_load, save)
    block_ids: list[int] = field(default_factory=list)
    # a hybrid model's block table per KV-cache group (block_ids is the first group's)
    group_blocks: list[list[int]] = field(default_factory=list)
    saved: int = 0  # tokens of the prompt already saved or planned (chunk aligned)
    load: tuple[int, int] | None = None  # (start, end) tokens to load in the next step
    hit: _Hit | None = None  # what the lookup found, for the load
    waiting: bool = False  # an asynchronous load was sent: vLLM allocates for it again


@dataclass(frozen=True)
class _Hit:
    """One lookup's answer for one request."""

    when: float
    matched: int  # tokens to count as loaded (whole blocks, or one short of the prompt)
    chunks: tuple[ChunkMatch, ...]
    groups: tuple[tuple[ChunkMatch, ...], ...] = ()  # hybrid: each group's chunks
    lent: tuple[LentLease | None, ...] = ()  # per chunk, its lease if the lookup lent it


def request_salt(request: Any) -> str:
    """The per-request part of the namespace: cache salt, multimodal items, LoRA."""
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


class KVStoreScheduler:
    """Lookups and per-step plans; the ``KVConnectorBase_V1`` scheduler-side methods."""

    def __init__(self, setup: Setup, client: BreakerClient, *, clock: Clock = monotonic) -> None:
        self.setup, self.client = setup, client
        self._clock = clock
        self.stats = KVStoreStats()
        self._reqs: dict[str, _Req] = {}
        self._hits: dict[str, tuple[int, _Hit, bool]] = {}  # (computed, hit, background)
        self._asked: dict[str, _Hit] = {}
        self._no_load: set[str] = set()  # their background load failed: they compute
        self._params: dict[str, RequestParams] = {}  # each request's kv_transfer_params
        mode = setup.cfg.load_mode
        self._prefetch = mode != "sync"
        # On this host the L1 copy runs at memory speed: no reason to wait a step for it.
        url = client.url
        local = setup.cfg.shm != "off" and (
            url.startswith("unix://") or url.startswith(("grpc://127.", "grpc://localhost:"))
        )
        self._always = {"sync": False, "async": True}.get(mode, not local)
        # A worker that reads L2 hits where they lie in LMDB's file (one pass, on the
        # server's host): a prefetch promoting them into L1 would be a second pass.
        self._reads_disk = local and setup.reads_disk
        # On this host the lookup also lends the chunks it found to the worker that loads
        # them (``Loads`` adopts them): the load needs no AcquireMany, which took 0.7-3 ms
        # of a 5-8 ms load from L2 (docs/performance.md). To a holder with no Session,
        # so leases of a load that never happens run out after lease_ms at the latest.
        self._lends = local and not setup.hybrid
        self._holder = f"kvstore-lent-{uuid.uuid4().hex}"
        # vllm_observe's hooks: its KV events learn of every save planned, and a prefix-cache
        # reset moves every later request to a new key generation.
        self.on_save: Callable[[str, int, int], None] | None = None
        self.generation = ""

    def _salt(self, request: Any) -> str:
        return with_generation(request_salt(request), self.generation)

    def reset_cache(self, generation: str) -> None:
        """vLLM reset its prefix cache (vllm_observe): later requests look up and store under
        ``generation``; lookup answers of the old one are dropped."""
        self.generation = generation
        self._let_go(*self._asked.values(), *(h for _, h, _ in self._hits.values()))
        self._asked.clear()
        self._hits.clear()

    def _let_go(self, *hits: _Hit | None) -> None:
        """End the leases these hits were lent (no load will take them), once each."""
        held = {id(h): h for h in hits if h is not None and h.lent}
        lent = [x for h in held.values() for x in h.lent if x is not None]
        if lent:
            self.client.release_lent(lent)

    def _background(self, hit: _Hit, computed: int) -> bool:
        """Load asynchronously: asked to, or a chunk to load is below the server's L1, or
        a hybrid model (vLLM takes its load failures only from requests that wait)."""
        if self.setup.hybrid:
            return True
        if self._always or not self._prefetch:
            return self._always
        return any(
            c.tier > TierLevel.MEMORY
            for c in hit.chunks
            if c.start + c.tokens > computed and c.start < hit.matched
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        s = self.setup
        tokens = list(request.prompt_token_ids or [])
        if not s.consumer or not tokens or request.request_id in self._no_load:
            return 0, False
        if not self._params_of(request).load:  # it asked not to be looked up
            return 0, False
        # A hit must leave one token to compute (vLLM asserts it): a prompt stored to its
        # last whole block loads that block too and reports one token less, so vLLM
        # computes one token, not a block (it rewrites that token's KV with the same values).
        limit = request.num_tokens - 1
        if limit <= num_computed_tokens:
            return 0, False
        # A request that cannot be scheduled yet is asked again every step: reuse a
        # fresh answer instead of one RPC per step.
        now = self._clock()
        hit = self._asked.get(request.request_id)
        if hit is None or now - hit.when >= _ASK_TTL_S:
            self._let_go(hit)
            if s.hybrid:
                hit = self._asked[request.request_id] = self._hybrid_hit(request, now, limit)
            else:
                hit = self._asked[request.request_id] = self._hit(
                    request, tokens, now, limit, num_computed_tokens
                )
            # The scheduling loop waits for the answer: on a miss this is most of what
            # kvstore costs the engine besides the saves (docs/performance.md, Serving).
            self.stats.add(lookup_s=self._clock() - now)
        if hit.matched <= num_computed_tokens:
            if hit.lent:  # nothing to load: the leases go now, the answer stays
                self._let_go(hit)
                self._asked[request.request_id] = replace(hit, lent=())
            return 0, False
        background = self._background(hit, num_computed_tokens)
        self._hits[request.request_id] = (num_computed_tokens, hit, background)
        return hit.matched - num_computed_tokens, background

    def _hit(self, request: Any, tokens: list[int], now: float, limit: int, computed: int) -> _Hit:
        """One Lookup's answer, the chunks from ``computed`` on lent with it where the
        workers read this server's memory."""
        s = self.setup
        ns = s.ns.for_request(self._salt(request))
        args: dict[str, Any] = dict(
            min_tokens=s.cfg.min_tokens,
            granularity=s.block_size,
            prefetch=self._prefetch,
            reads_disk=self._reads_disk,
        )
        lent: list[LentLease | None] = []
        if self._lends and (len(tokens) - computed) // s.chunk_tokens <= _LEND_CHUNKS:
            got = self.client.lookup_lend(
                ns, tokens, lend_from=computed, holder=self._holder, **args
            )
            result, lent = got if got is not None else (None, [])
        else:
            result = self.client.lookup(ns, tokens, **args)
        rows = list(result.chunks) if result else []
        matched = result.matched_tokens if result else 0
        if s.window:  # a window's records serve a hit only where they end
            matched = max(
                (c.start + c.tokens for c in whole_chunks(rows) if c.start + c.tokens <= matched),
                default=0,
            )
        matched = min(matched, limit)
        lent = lent or [None] * len(rows)
        unused = [x for c, x in zip(rows, lent, strict=True) if x and c.start >= matched]
        if unused:
            self.client.release_lent(unused)
        keep = [(c, x) for c, x in zip(rows, lent, strict=True) if c.start < matched]
        chunks = tuple(c for c, _ in keep)
        held = tuple(x for _, x in keep) if any(x for _, x in keep) else ()
        return _Hit(now, matched, chunks, lent=held)

    def _hybrid_hit(self, request: Any, now: float, limit: int) -> _Hit:
        """A hybrid model's hit: the longest prefix every KV-cache group can serve, one
        Lookup per group (each group's chunks are keyed apart). A full-attention group
        serves any block its records cover; a sliding-window group only the ends of its
        records (they hold the blocks before the end, within the window)."""
        s = self.setup
        found = []
        for g in range(len(s.groups)):
            gs = s.for_group(g)
            result = self.client.lookup(
                gs.ns.for_request(self._salt(request)),
                list(request.prompt_token_ids or []),
                min_tokens=s.cfg.min_tokens,
                granularity=s.block_size,
                prefetch=self._prefetch,
                reads_disk=self._reads_disk,
            )
            chunks = tuple(result.chunks) if result else ()
            found.append((gs.window, result.matched_tokens if result else 0, chunks))
        matched = min(m for w, m, _ in found if not w) if any(not w for w, _, _ in found) else limit
        while True:  # down to a point every windowed group's records end at
            ends = [
                max((c.start + c.tokens for c in whole_chunks(ch) if c.start + c.tokens <= matched),
                    default=0)
                for w, _, ch in found
                if w
            ]  # fmt: skip
            if not ends or min(ends) == matched:
                break
            matched = min(ends)
        matched = min(matched, limit)
        groups = tuple(tuple(c for c in ch if c.start < matched) for _, _, ch in found)
        return _Hit(now, matched, groups[0], groups)

    def _params_of(self, request: Any) -> RequestParams:
        """What the request asks of kvstore (its kv_transfer_params), read once a request;
        what was wrong with them is logged once (``request_params`` says what holds)."""
        got = self._params.get(request.request_id)
        if got is None:
            params = getattr(request, "kv_transfer_params", None)
            got, problems = request_params(params, self.setup.cfg)
            for problem in problems:  # a bad request must not stop the engine
                log.warning("kvstore: request %s: %s", request.request_id, problem)
            self._params[request.request_id] = got
        return got

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        s = self.setup
        tokens = list(request.prompt_token_ids or [])
        r = self._reqs.get(request.request_id)
        if r is None:
            asks = self._params_of(request)
            r = self._reqs[request.request_id] = _Req(tokens, self._salt(request), asks=asks)
        elif r.waiting:  # allocated again once its background load is over: nothing new
            r.waiting = False
            return
        found = self._hits.pop(request.request_id, None)
        asked = self._asked.pop(request.request_id, None)
        if num_external_tokens > 0 and found is not None:
            start, hit, background = found
            if asked is not hit:
                self._let_go(asked)
            r.load = (start, start + num_external_tokens)
            r.hit = hit  # its leases go to the workers with the load
            if background:
                # Not among the step's scheduled requests: its blocks are these.
                r.group_blocks = [list(b) for b in blocks.get_block_ids()]
                r.block_ids = r.group_blocks[0]
                r.waiting = True
            # Exact chunks that were loaded need no save; a partial one does (new key). A
            # hit one token short of the prompt's end loaded its last block whole.
            loaded = s.blocks(start + num_external_tokens) * s.block_size
            r.saved = max(r.saved, loaded // s.chunk_tokens * s.chunk_tokens)
            self.stats.add(lookup_hits=1, hit_tokens=num_external_tokens)
            return
        self._let_go(asked, found[1] if found is not None else None)
        if s.consumer and self._params_of(request).load:
            self.stats.add(lookup_misses=1)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreMeta:
        meta = KVStoreMeta(computing=getattr(scheduler_output, "total_num_scheduled_tokens", 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            meta.preempted.append(rid)  # a load still writing into its blocks stops
            if rid not in resumed:  # its blocks are gone; it comes back through a new lookup
                gone = self._reqs.pop(rid, None)
                self._let_go(gone.hit if gone is not None else None)
        for rid, waiting in self._reqs.items():
            if waiting.waiting and waiting.load is not None:  # not scheduled this step
                meta.loads.append(self._load_spec(rid, waiting, background=True))
        for new in scheduler_output.scheduled_new_reqs:
            r = self._reqs.get(new.req_id)
            if r is not None:
                r.group_blocks = [list(b) for b in new.block_ids]
                r.block_ids = r.group_blocks[0]
                self._plan(meta, new.req_id, r, new.num_computed_tokens, scheduler_output)
        for i, rid in enumerate(cached.req_ids):
            r = self._reqs.get(rid)
            if r is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in resumed:  # resumed: the full block table
                r.group_blocks = [list(b) for b in nb] if nb else [[] for _ in r.group_blocks]
                r.block_ids = r.group_blocks[0] if r.group_blocks else []
            elif nb:
                for have, new_ids in zip(r.group_blocks, nb, strict=True):
                    have.extend(new_ids)  # running: appended blocks only
            self._plan(meta, rid, r, cached.num_computed_tokens[i], scheduler_output)
        for spec in meta.loads:  # drop_after_load: the workers drop its chunks once loaded
            req = self._reqs.get(spec.req_id)
            spec.drop = req is not None and req.asks.drop_after_load
        return meta

    def _plan(self, meta: KVStoreMeta, rid: str, r: _Req, computed: int, so: Any) -> None:
        s = self.setup
        bs = s.block_size
        if r.load is not None:
            meta.loads.append(self._load_spec(rid, r, background=False))
        if not s.producer or not r.asks.save:
            return
        done = min(computed + so.num_scheduled_tokens.get(rid, 0), len(r.tokens))
        # Whole chunks completed so far, and at the end of the prefill its last whole blocks.
        # Not with a sliding window (Setup.whole_chunks_only): its hits end on a chunk
        # boundary.
        upto = done // s.chunk_tokens * s.chunk_tokens
        if done == len(r.tokens) and not s.whole_chunks_only:
            upto = done // bs * bs
        if upto > r.saved and all(len(b) * bs >= upto for b in r.group_blocks):
            for g, ids in enumerate(r.group_blocks):  # one group unless hybrid
                meta.saves.append(
                    SaveSpec(rid, r.tokens[:upto], r.salt, r.saved, ids[: upto // bs], group=g)
                )
            if self.on_save is not None:
                self.on_save(rid, r.saved, upto)
            r.saved = upto

    def _load_spec(self, rid: str, r: _Req, *, background: bool) -> LoadSpec:
        """The workers' part of a planned load: its blocks and the chunks found for it."""
        s = self.setup
        bs = s.block_size
        assert r.load is not None
        start, end = r.load
        whole = s.blocks(end)
        found = r.hit.chunks if r.hit is not None else ()
        lent = (r.hit.lent if r.hit is not None else ()) or (None,) * len(found)
        chunks = tuple(
            ChunkRef(c.key, c.start, c.tokens, c.stored_tokens, c.partial, x)
            for c, x in zip(found, lent, strict=True)
            if c.start < whole * bs
        )
        unused = [x for c, x in zip(found, lent, strict=True) if x and c.start >= whole * bs]
        if unused:  # those the workers get are theirs to end (Loads)
            self.client.release_lent(unused)
        if s.hybrid and r.hit is not None:
            r.load, hit, r.hit = None, r.hit, None
            return self._hybrid_load(rid, r, start, end, hit)
        # A window's blocks before it at the hit are vLLM's null block: not loaded.
        start = max(start, s.kept_from(end))
        spec = LoadSpec(
            rid,
            r.tokens[: whole * bs],
            r.salt,
            start,
            end,
            r.block_ids[start // bs : whole],
            chunks=chunks,
            fingerprint=s.ns.for_request(r.salt).fingerprint,
            background=background,
        )
        r.load, r.hit = None, None
        return spec

    def _hybrid_load(self, rid: str, r: _Req, start: int, end: int, hit: _Hit) -> LoadSpec:
        """A hybrid model's load: every group's blocks from ``start`` (a sliding-window
        group's only from its window at ``end``: vLLM allocated the null block before it),
        always in the background, where vLLM takes a failure per request."""
        s = self.setup
        bs = s.block_size
        whole = s.blocks(end)
        parts = []
        for g, chunks in enumerate(hit.groups):
            gs = s.for_group(g)
            first = max(start, gs.kept_from(end))
            parts.append(
                GroupLoad(
                    g,
                    first,
                    r.group_blocks[g][first // bs : whole],
                    # Every chunk from the first: a worker of another TP rank chains its
                    # keys over them (Loads._chunks); only those with blocks to fill load.
                    tuple(
                        ChunkRef(c.key, c.start, c.tokens, c.stored_tokens, c.partial)
                        for c in chunks
                        if c.start < whole * bs
                    ),
                    gs.ns.for_request(r.salt).fingerprint,
                )
            )
        return LoadSpec(
            rid,
            r.tokens[: whole * bs],
            r.salt,
            start,
            end,
            [b for part in parts for b in part.block_ids],
            background=True,
            groups=tuple(parts),
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """A load failed (vLLM recomputes those blocks): save them again once computed,
        and do not load that request again (a load that keeps failing would loop)."""
        s = self.setup
        for rid in getattr(connector_output, "failed_recving", None) or ():
            r = self._reqs.get(rid)  # a hybrid model's failed load: vLLM recomputes it whole
            if r is not None:
                r.saved = 0
                self._no_load.add(rid)
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not invalid:
            return
        for rid, r in self._reqs.items():
            bad = [i for i, b in enumerate(r.block_ids) if b in invalid]
            if bad:
                first = bad[0] * s.block_size
                r.saved = min(r.saved, first // s.chunk_tokens * s.chunk_tokens)
                if r.waiting:
                    self._no_load.add(rid)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        r = self._reqs.pop(request.request_id, None)
        found = self._hits.pop(request.request_id, None)
        asked = self._asked.pop(request.request_id, None)
        # A hit lent but not sent to the workers (a load planned is theirs to end)
        self._let_go(r.hit if r is not None else None, found[1] if found else None, asked)
        self._no_load.discard(request.request_id)
        self._params.pop(request.request_id, None)
        # A background load still running keeps its blocks: vLLM frees them only once a
        # worker reports the request in finished_recving (at the latest its deadline).
        return False, None  # saves finish inside their step: the blocks may be freed now

    def get_stats(self) -> KVStoreStats | None:
        """This side's counters since the last call (None: nothing counted)."""
        errors = self.client.take_errors()
        if errors:
            self.stats.add(errors=errors)
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVStoreStats()
        return out

    def shutdown(self) -> None:
        self._let_go(
            *self._asked.values(),
            *(h for _, h, _ in self._hits.values()),
            *(r.hit for r in self._reqs.values()),
        )
        self.client.close()
