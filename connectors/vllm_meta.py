"""What the connector's two halves share: the settings both are built with, the plan the
scheduler half hands the worker half each step (pickled to the workers), and the counters
both report to vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.connectors.vllm_config import ConnectorConfig
from kvstore.connectors.vllm_namespace import EngineNamespace
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


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

    def blocks(self, tokens: int) -> int:
        """Blocks holding tokens [0, tokens): the last one may hold later tokens too."""
        return -(-tokens // self.block_size)


class ChunkRef(NamedTuple):
    """One stored chunk the scheduler's lookup matched (``kvstore.types.ChunkMatch``
    without what the worker does not need): the worker loads it without looking up again."""

    key: bytes  # the stored chunk's key, in the scheduler's namespace (rank 0)
    start: int  # offset of its first token in the prompt
    tokens: int  # tokens of the prompt it serves (whole blocks)
    stored_tokens: int  # tokens the stored chunk holds (more when only a prefix matches)
    partial: bool  # a stored sibling of which only a prefix matches the prompt


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


@dataclass
class SaveSpec:
    req_id: str
    tokens: list[int]  # the prompt up to the end of the last chunk to save
    salt: str
    start: int  # first chunk start to save (chunk aligned)
    block_ids: list[int]  # the request's blocks for tokens [0, len(tokens))


@dataclass
class KVStoreMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # requests preempted since the last step: their blocks are freed, so any load still
    # writing into them is stopped (handle_preemptions)
    preempted: list[str] = field(default_factory=list)


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
