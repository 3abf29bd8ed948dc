"""Settings of the vLLM connector, from ``kv_connector_extra_config``, checked at start."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvstore.config import build, check_choices, parse_size
from kvstore.errors import ConfigError

ShmMode = Literal["auto", "on", "off"]
SaveMode = Literal["auto", "sync", "async"]
LoadMode = Literal["auto", "sync", "async"]
CpusMode = Literal["auto", "off"]


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys. Unknown keys and bad values fail at engine start."""

    # kvstore-server URL (unix:///path, grpc://host:port, grpcs://...); "" = a private
    # server for this engine
    url: str = ""
    chunk_tokens: int = (
        0  # tokens per chunk; 0 = the server's; must be a multiple of the block size
    )
    min_tokens: int = 0  # hits shorter than this are ignored (not worth a round trip)
    timeout_ms: int = 2000  # deadline of every call to the server (lookups, loads, saves)
    lookup_timeout_ms: int = (
        200  # deadline of the scheduler's lookup: it must never stall scheduling
    )
    auth_token: str = ""  # bearer token, when the server requires one
    salt: str = ""  # tenant / cache salt folded into every key (requests' cache_salt adds to it)
    shm: ShmMode = "auto"  # shared-memory data plane: auto (when on the same host), on, off
    # after a call that could not reach the server (unavailable, past its deadline), skip
    # the server this long before trying again; other errors do not count
    retry_after_ms: int = 5000
    save: bool = True  # store prefill KV (kv_producer / kv_both)
    load: bool = True  # load hits (kv_consumer / kv_both)
    # sync: a step's saves are stored before the step ends; async: they are queued and
    # stored by a background thread while the engine goes on; auto: async for kv_both on
    # a GPU, sync otherwise (a P/D producer's saves must be there when its answer is)
    save_mode: SaveMode = "auto"
    save_buffer: str = "1GiB"  # async saves: most host memory held by saves not yet stored
    # sync: a hit is loaded inside the step that computes the rest of the prompt; async:
    # the request waits (WAITING_FOR_REMOTE_KVS) while a worker thread loads it and other
    # requests run; auto: sync when every chunk of the hit is in the server's L1 on this
    # host (a copy at memory speed), async when some are on disk, in Redis/Valkey, or the
    # server is on another host
    load_mode: LoadMode = "auto"
    # the longest an asynchronous load may take, from the step that starts it: past it
    # the blocks not loaded yet are reported failed and vLLM computes them
    load_deadline_ms: int = 5000
    # CPU engines: a hit loaded in the step, of load_by_layer_bytes or more, is copied one
    # layer at a time while the forward pass runs, each attention layer waiting for its
    # own layer only; a chunk whose bytes do not verify is found after the forward pass
    # used it, reported, and recomputed (vLLM drops the token that step sampled for the
    # request). false, or a smaller load: every layer is copied and verified before the
    # forward pass starts
    load_by_layer: bool = True
    # the smallest load copied layer by layer: below it, copying before the forward pass
    # (two threads) cost less time to first token here (32 MiB: 1.16 against 1.27 of the
    # compute floor; 128 MiB: 1.23 against 1.15; docs/performance.md)
    load_by_layer_bytes: str = "64MiB"
    # the share of time an asynchronous load copies while the engine computes other
    # requests; between chunks it sleeps the rest, leaving the spare core and memory
    # bandwidth to the running decodes. With nothing else computing it copies flat out.
    # 1.0: always flat out
    background_load_share: float = 0.33
    # CPU engines: auto runs the background loader and the async saver on the cores vLLM
    # reserves (not on the ones its compute threads are bound to; see vllm_cpus), off
    # leaves them on the worker's own cores
    background_cpus: CpusMode = "auto"
    # CPU engines: fault in every page of vLLM's paged KV cache at start, in the background
    # (vLLM leaves it untouched, and a load into a never-used block paid its page faults)
    prefault_kv_cache: bool = True
    memory_capacity: str = "2GiB"  # private server only: L1 arena size
    disk_capacity: str = "16GiB"  # private server only: L2 size
    # private server only: where L2 lives; "" = a cache slot under $XDG_CACHE_HOME/kvstore/vllm
    # (~/.cache/kvstore/vllm), kept across restarts (see vllm_private)
    data_dir: str = ""
    # private server only, without data_dir: false keeps L2 in a temporary directory,
    # removed when the engine stops (every start then begins with an empty cache)
    persist: bool = True
    # a consumer deletes the chunks it loaded from the server once their load landed (a
    # one-shot P/D transfer that should not occupy the cache); a chunk another client
    # or request holds a lease on stays until the last lease ends. A request overrides
    # it with kv_transfer_params {"kvstore": {"drop_after_load": true|false}}
    drop_after_load: bool = False

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("unix://", "grpc://", "grpcs://")):
            raise ConfigError(
                f"kv_connector_extra_config.url={self.url!r}: use unix:///path, grpc://host:port "
                "or grpcs://host:port"
            )
        if self.chunk_tokens < 0 or self.min_tokens < 0:
            raise ConfigError("kv_connector_extra_config: chunk_tokens and min_tokens must be >= 0")
        if (
            self.timeout_ms <= 0
            or self.lookup_timeout_ms <= 0
            or self.load_deadline_ms <= 0
            or self.retry_after_ms < 0
        ):
            raise ConfigError(
                "kv_connector_extra_config: timeout_ms, lookup_timeout_ms and "
                "load_deadline_ms must be > 0, retry_after_ms >= 0"
            )
        if not 0 < self.background_load_share <= 1:
            raise ConfigError(
                f"kv_connector_extra_config.background_load_share="
                f"{self.background_load_share!r}: a share of the time, > 0 and <= 1 "
                "(1: a background load copies flat out)"
            )
        check_choices(self, "kv_connector_extra_config")
        if self.data_dir and not self.persist:
            raise ConfigError(
                "kv_connector_extra_config: persist=false and data_dir both given; a data_dir "
                "is kept across restarts: drop one of them"
            )
        if self.load_by_layer_min_bytes < 0:
            raise ConfigError(
                "kv_connector_extra_config.load_by_layer_bytes must be >= 0 (e.g. 64MiB)"
            )
        if self.save_buffer_bytes <= 0:
            raise ConfigError("kv_connector_extra_config.save_buffer must be > 0 (e.g. 1GiB)")
        if self.drop_after_load and not self.load:
            raise ConfigError(
                "kv_connector_extra_config: drop_after_load=true drops what this engine "
                "loads, and load=false loads nothing: drop one of them"
            )

    @property
    def load_by_layer_min_bytes(self) -> int:
        return parse_size(self.load_by_layer_bytes, "kv_connector_extra_config.load_by_layer_bytes")

    @property
    def save_buffer_bytes(self) -> int:
        return parse_size(self.save_buffer, "kv_connector_extra_config.save_buffer")

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        values = dict(extra or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(names))}"
            )
        return build(cls, values, "kv_connector_extra_config")

    @property
    def shm_flag(self) -> bool | None:
        return {"auto": None, "on": True, "off": False}[self.shm]


@dataclass(frozen=True)
class RequestParams:
    """What one request asks of the connector: its ``kv_transfer_params``
    ``{"kvstore": {...}}`` (the JSON body of an OpenAI request, or
    ``SamplingParams.extra_args["kv_transfer_params"]``). A request can turn loading or
    saving off for itself, not on where the engine has it off."""

    load: bool = True  # look it up and load its hit (false: it computes its whole prompt)
    save: bool = True  # store its prompt's KV (false: nothing of it reaches the server)
    drop_after_load: bool = False  # the chunks it loaded are dropped once loaded

    @classmethod
    def of_engine(cls, cfg: ConnectorConfig) -> RequestParams:
        """A request that says nothing: the engine's settings."""
        return cls(drop_after_load=cfg.drop_after_load)


_REQUEST_KEYS = tuple(f.name for f in dataclasses.fields(RequestParams))
_WHERE = 'kv_transfer_params["kvstore"]'


def request_params(
    kv_transfer_params: Any, cfg: ConnectorConfig
) -> tuple[RequestParams, list[str]]:
    """One request's ``RequestParams`` and what was wrong with them, each a message that says
    what is allowed (the scheduler logs them; they never fail the request). Booleans are
    read as the engine's settings are (``true``, ``"false"``, ``0``...). A value that cannot
    be read turns ``load`` or ``save`` off (a request that asked not to be stored is not
    stored for a typo), ``drop_after_load`` stays the engine's; an unknown key is ignored;
    a ``"kvstore"`` that is not a table of these turns both off."""
    got = RequestParams.of_engine(cfg)
    params = kv_transfer_params if isinstance(kv_transfer_params, Mapping) else {}
    ours = params.get("kvstore")
    if ours is None:
        return got, []
    allowed = ", ".join(f'"{k}": true|false' for k in _REQUEST_KEYS)
    if not isinstance(ours, Mapping):
        off = dataclasses.replace(got, load=False, save=False)
        return off, [f"{_WHERE}={ours!r}: expected {{{allowed}}}; load and save are off for it"]
    problems = []
    for key, value in ours.items():
        if key not in _REQUEST_KEYS:
            problems.append(f"{_WHERE}: unknown key {key!r} ignored; allowed: {{{allowed}}}")
            continue
        try:
            got = build(RequestParams, {**dataclasses.asdict(got), key: value}, _WHERE)
        except ConfigError as e:
            if key == "drop_after_load":
                problems.append(f"{e}; the engine's drop_after_load holds for it")
            else:
                got = dataclasses.replace(got, **{key: False})
                problems.append(f"{e}; {key} is off for it")
    return got, problems
