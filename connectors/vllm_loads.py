"""The worker half's loads: the blocks a step's hits cover, read from the server and
copied into the paged KV cache before the forward pass.

Loads are synchronous and bounded: ``Loads.load`` runs in ``start_load_kv``, every
call to the server under ``timeout_ms``. Same-host loads run at memory speed, so
the async path's extra scheduler step would cost more TTFT than it hides. A block
that is not loaded (the server is down, the record is gone, corrupt, of another
layout, or its tokens differ) is returned as failed: vLLM recomputes it. Nothing
here raises: an exception in ``start_load_kv`` would kill the engine.

``Loads.load`` is the whole load path, one call per step with the step's specs, so
another way of loading (batched leases, asynchronous loads) replaces this class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.connectors.vllm_blocks import BlockLayout
from kvstore.connectors.vllm_client import BreakerClient
from kvstore.connectors.vllm_meta import LoadSpec, Setup

from kvstore.keys import tokens_to_bytes


@dataclass
class LoadOutcome:
    """What one step's loads did."""

    loaded_tokens: int = 0  # tokens whose KV is now in the cache
    failed: set[int] = field(default_factory=set)  # block ids not loaded: vLLM recomputes them


class Loads:
    """Loads the hits of one worker, synchronously, in the step that asks for them."""

    def __init__(self, setup: Setup, layout: BlockLayout, client: BreakerClient) -> None:
        self.setup, self.layout, self.client = setup, layout, client

    def load(self, specs: Sequence[LoadSpec]) -> LoadOutcome:
        """Load every spec of a step; what was loaded and which blocks were not."""
        out = LoadOutcome()
        for spec in specs:
            try:
                out.loaded_tokens += self._load(spec, out.failed)
            except Exception as e:  # a bug, not the server: this request computes instead
                self.client.failed("load", e)
                out.failed.update(spec.block_ids)
        return out

    def _load(self, spec: LoadSpec, failed: set[int]) -> int:
        """Load one request's hit; the tokens loaded. Blocks not loaded go to ``failed``."""
        bs, layout = self.setup.block_size, self.layout
        ns = self.setup.ns.for_request(spec.salt)
        result = self.client.lookup(ns, spec.tokens, granularity=bs, worker=True)
        whole = self.setup.blocks(spec.end)
        todo = dict(zip(range(spec.start // bs, whole), spec.block_ids, strict=True))
        for match in result.chunks if result else ():
            first = match.start // bs
            blocks = [b for b in range(first, first + match.tokens // bs) if b in todo]
            if not blocks:
                continue
            stored = match.stored_tokens // bs
            buf = layout.host_buffer(layout.nbytes(stored))
            header = self.client.get_into(match.key, buf)
            if header is None or header.raw_size != buf.numel():
                continue  # gone or another layout: those blocks are reported below
            want = tokens_to_bytes(spec.tokens[match.start : match.start + match.tokens])
            if header.token_bytes[: len(want)] != want:
                # A partial match rests on 8-byte sub-hashes; the record's own token ids
                # have the last word, so colliding tokens are recomputed, never loaded.
                continue
            # Blocks of the chunk before spec.start are computed locally: only ``blocks`` move.
            layout.scatter(buf, stored, [todo.pop(b) for b in blocks], first=blocks[0] - first)
        failed.update(todo.values())
        missed = sum(min((b + 1) * bs, spec.end) - max(b * bs, spec.start) for b in todo)
        return (spec.end - spec.start) - missed
