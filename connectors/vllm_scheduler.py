"""The scheduler half of the connector, in vLLM's engine-core process.

It answers ``get_num_new_matched_tokens`` with one Lookup RPC under a short
deadline (``lookup_timeout_ms``: it must never stall scheduling), and plans per
step which blocks the workers load and which chunks became complete and are to
be saved (``KVStoreMeta``, pickled to the workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.connectors.vllm_client import BreakerClient
from kvstore.connectors.vllm_meta import KVStoreMeta, KVStoreStats, LoadSpec, SaveSpec, Setup

from kvstore.clock import Clock, monotonic

_ASK_TTL_S = 1.0  # how long a lookup answer is reused for a request that keeps waiting


@dataclass
class _Req:
    """Scheduler-side state of one running request."""

    tokens: list[int]
    salt: str
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # tokens of the prompt already saved or planned (chunk aligned)
    load: tuple[int, int] | None = None  # (start, end) tokens to load in the next step


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
        self._hits: dict[str, tuple[int, int]] = {}
        self._asked: dict[str, tuple[float, int]] = {}  # req_id -> (when, matched tokens)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        s = self.setup
        tokens = list(request.prompt_token_ids or [])
        if not s.consumer or not tokens:
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
        cached = self._asked.get(request.request_id)
        if cached is not None and now - cached[0] < _ASK_TTL_S:
            matched = cached[1]
        else:
            ns = s.ns.for_request(request_salt(request))
            result = self.client.lookup(
                ns, tokens, min_tokens=s.cfg.min_tokens, granularity=s.block_size
            )
            matched = min(result.matched_tokens if result else 0, limit)
            self._asked[request.request_id] = (now, matched)
        if matched <= num_computed_tokens:
            return 0, False
        self._hits[request.request_id] = (num_computed_tokens, matched)
        return matched - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        s = self.setup
        tokens = list(request.prompt_token_ids or [])
        r = self._reqs.get(request.request_id)
        if r is None:
            r = self._reqs[request.request_id] = _Req(tokens, request_salt(request))
        hit = self._hits.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        if num_external_tokens > 0 and hit is not None:
            start = hit[0]
            r.load = (start, start + num_external_tokens)
            # Exact chunks that were loaded need no save; a partial one does (new key). A
            # hit one token short of the prompt's end loaded its last block whole.
            loaded = s.blocks(start + num_external_tokens) * s.block_size
            r.saved = max(r.saved, loaded // s.chunk_tokens * s.chunk_tokens)
            self.stats.add(lookup_hits=1, hit_tokens=num_external_tokens)
        elif s.consumer:
            self.stats.add(lookup_misses=1)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreMeta:
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
        s = self.setup
        bs = s.block_size
        if r.load is not None:
            start, end = r.load
            whole = s.blocks(end)
            blocks = r.block_ids[start // bs : whole]
            meta.loads.append(LoadSpec(rid, r.tokens[: whole * bs], r.salt, start, end, blocks))
            r.load = None
        if not s.producer:
            return
        done = min(computed + so.num_scheduled_tokens.get(rid, 0), len(r.tokens))
        # Whole chunks completed so far, and at the end of the prefill its last whole blocks.
        upto = done // s.chunk_tokens * s.chunk_tokens
        if done == len(r.tokens):
            upto = done // bs * bs
        if upto > r.saved and len(r.block_ids) * bs >= upto:
            meta.saves.append(
                SaveSpec(rid, r.tokens[:upto], r.salt, r.saved, r.block_ids[: upto // bs])
            )
            r.saved = upto

    def update_connector_output(self, connector_output: Any) -> None:
        """A load failed (vLLM recomputes those blocks): save them again once computed."""
        s = self.setup
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not invalid:
            return
        for r in self._reqs.values():
            bad = [i for i, b in enumerate(r.block_ids) if b in invalid]
            if bad:
                first = bad[0] * s.block_size
                r.saved = min(r.saved, first // s.chunk_tokens * s.chunk_tokens)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
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
        self.client.close()
