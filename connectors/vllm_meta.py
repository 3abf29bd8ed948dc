"""What the connector's two halves share: the settings both are built with, the plan the
scheduler half hands the worker half each step (pickled to the workers), and the counters
both report to vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore.keys import ChunkKey
from kvstore.sdk import LentLease

from .vllm_config import ConnectorConfig
from .vllm_namespace import EngineNamespace, Group


@dataclass(frozen=True)
class Setup:
    """What one half of the connector is built with (the facade derives it from vLLM's
    config; tests build it directly)."""

    cfg: ConnectorConfig
    ns: EngineNamespace  # this process's namespace (a worker's has its TP/PP rank)
    block_size: int  # tokens per vLLM cache block
    chunk_tokens: int  # tokens per stored chunk, a multiple of block_size
    producer: bool  # stores KV (kv_producer / kv_both, and cfg.save)
    consumer: bool  # loads KV (kv_consumer / kv_both, and cfg.load)
    # vLLM's KV-cache groups; () or one group: every layer shares one block table
    groups: tuple[Group, ...] = ()
    # the sliding window in tokens of a per-group Setup (``for_group``), or of the one
    # group of a model whose every layer is windowed; 0: full attention
    window: int = 0

    def blocks(self, tokens: int) -> int:
        """Blocks holding tokens [0, tokens): the last one may hold later tokens too."""
        return -(-tokens // self.block_size)

    @property
    def hybrid(self) -> bool:
        """More than one KV-cache group (vLLM's HMA on, a hybrid model)."""
        return len(self.groups) > 1

    @property
    def reads_disk(self) -> bool:
        """Whether workers copy L2 hits from where they lie in the server's LMDB file
        (lent in place, on the server's host), so the scheduler's prefetch leaves them
        there: host-memory workers do; a CUDA worker copies from the arena registered
        with the device only, so it has them promoted into L1."""
        return self.ns.base.device != "cuda"

    @property
    def whole_chunks_only(self) -> bool:
        """Store whole chunks only: a window's records hold as many blocks for a short
        chunk as for a whole one, and the server pins a namespace's bytes per token."""
        return self.hybrid or bool(self.window)

    def for_group(self, g: int) -> Setup:
        """This Setup as one group's: its namespace (keys of its own) and its window."""
        if not self.hybrid:
            return self
        return replace(self, ns=self.ns.of_group(g), window=self.groups[g].window, groups=())

    def kept_from(self, computed: int) -> int:
        return kept_from(self.block_size, self.window, computed)

    def record_blocks(self, start: int, end: int) -> tuple[int, int]:
        return record_blocks(self.block_size, self.window, start, end)


def kept_from(block_size: int, window: int, computed: int) -> int:
    """The first token of the first block vLLM keeps once ``computed`` tokens are
    computed: 0 with full attention; with a sliding window of W tokens the block holding
    token computed - W + 1, the oldest one the next token attends to (vLLM's
    ``SlidingWindowManager.get_num_skipped_tokens``: the blocks before it are freed, and
    those of a hit are allocated as the null block)."""
    if not window:
        return 0
    return max(0, computed - window + 1) // block_size * block_size


def record_blocks(block_size: int, window: int, start: int, end: int) -> tuple[int, int]:
    """The blocks a stored chunk of tokens [start, end) holds, as (first, end) block
    indices in the prompt: all of them with full attention; with a sliding window only
    those a hit at ``end`` still reads, or at ``end - 1`` (a prompt stored to its end:
    vLLM computes its last token again), i.e. from ``kept_from(end - 1)``. A hit at a
    later chunk's end reads no earlier block of this one, so that is all it ever needs."""
    return max(start, kept_from(block_size, window, end - 1)) // block_size, end // block_size


class ChunkRef(NamedTuple):
    """One stored chunk the scheduler's lookup matched (``kvstore.types.ChunkMatch``
    without what the worker does not need): the worker loads it without looking up again."""

    key: ChunkKey  # the stored chunk's key, in the scheduler's namespace (rank 0)
    start: int  # offset of its first token in the prompt
    tokens: int  # tokens of the prompt it serves (whole blocks)
    stored_tokens: int  # tokens the stored chunk holds (more when only a prefix matches)
    partial: bool  # a stored sibling of which only a prefix matches the prompt
    # Its lease, lent by the lookup (the worker of the scheduler's namespace reads through
    # it and ends it: ``Loads``); None: the worker acquires the chunk itself.
    lent: LentLease | None = None


class _Matched(Protocol):
    @property
    def tokens(self) -> int: ...
    @property
    def stored_tokens(self) -> int: ...


_C = TypeVar("_C", bound=_Matched)


def whole_chunks(chunks: Sequence[_C]) -> list[_C]:
    """The matched chunks up to the first one the prompt matches only part of: what a
    sliding-window group can serve. Its records hold only the blocks near their end, so a
    hit must end where a record ends."""
    out = []
    for c in chunks:
        if c.tokens != c.stored_tokens:
            break
        out.append(c)
    return out


@dataclass
class GroupLoad:
    """One KV-cache group's part of a hybrid model's load."""

    group: int
    start: int  # first token it loads: the load's start, or a sliding window's at the hit
    block_ids: list[int]  # its blocks for tokens [start, LoadSpec.end), the last one whole
    chunks: tuple[ChunkRef, ...]  # the lookup's chunks of this group's keys
    fingerprint: bytes  # of the namespace those keys are in


@dataclass
class LoadSpec:
    req_id: str
    tokens: list[int]  # the prompt up to the end of the block holding token ``end - 1``
    salt: str  # per-request part of the namespace (cache_salt, LoRA)
    start: int  # first token to load (block aligned; earlier ones are computed locally)
    end: int  # one past the last token vLLM counts as loaded (may end inside a block)
    block_ids: list[int]  # the cache blocks for tokens [start, end), the last one whole
    # What the scheduler's lookup found for tokens [start, end), in prompt order; keys in
    # the namespace whose fingerprint is ``fingerprint`` (a worker of another TP/PP rank
    # derives its own). Empty: the worker looks the prompt up itself.
    chunks: tuple[ChunkRef, ...] = ()
    fingerprint: bytes = b""
    background: bool = False  # an asynchronous load: reported through get_finished
    drop: bool = False  # drop_after_load: its chunks are dropped from the server once loaded
    # A hybrid model's load, one part per KV-cache group (``block_ids`` then holds every
    # group's blocks, ``chunks`` is empty); () for one group.
    groups: tuple[GroupLoad, ...] = ()

    @property
    def in_step(self) -> bool:
        """Loaded in the step, in place, before or beside its forward pass. A hybrid
        model's loads are all asynchronous: vLLM takes their failures only per request
        (failed_recving), and those only of requests waiting for their load."""
        return not self.background and not self.groups


@dataclass
class SaveSpec:
    req_id: str
    tokens: list[int]  # the prompt up to the end of the last chunk to save
    salt: str
    start: int  # first chunk start to save (chunk aligned)
    block_ids: list[int]  # the request's blocks for tokens [0, len(tokens))
    group: int = 0  # the KV-cache group these blocks are of (hybrid models)


@dataclass
class KVStoreMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # requests preempted since the last step: their blocks are freed, so any load still
    # writing into them is stopped (handle_preemptions)
    preempted: list[str] = field(default_factory=list)
    # tokens this step computes (any request's): a background load yields to them
    computing: int = 0


@dataclass
class KVStoreStats(KVConnectorStats):
    """Counters that vLLM aggregates across workers and logs (hits, tokens, seconds)."""

    def reset(self) -> None:
        self.data: dict[str, int | float] = {}

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
