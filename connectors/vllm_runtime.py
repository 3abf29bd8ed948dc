"""What the vLLM connector needs around the SDK: the engine's namespace, and a client that
backs off when the server fails (opening the embedded default's private server,
``vllm_private``, when no url is given)."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvstore.connectors.vllm_config import ConnectorConfig
from kvstore.connectors.vllm_private import PrivateServer, open_private
from vllm.logger import init_logger

from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, Fingerprint, Namespace
from kvstore.records import RecordHeader
from kvstore.types import LookupResult

log = init_logger("vllm.kvstore.connector")

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class EngineNamespace:
    """The engine's namespace; requests add their cache salt and LoRA to it."""

    base: Namespace

    def for_request(self, salt: str) -> Namespace:
        if not salt:
            return self.base
        return replace(self.base, salt=f"{self.base.salt}|{salt}" if self.base.salt else salt)

    @property
    def fingerprint(self) -> Fingerprint:
        return self.base.fingerprint

    def describe(self) -> str:
        b = self.base
        return (
            f"{b.model} {b.dtype} {b.layout} {b.device} "
            f"tp{b.tp_rank}/{b.tp_size} pp{b.pp_rank}/{b.pp_size}"
        )


def _ranks(worker: bool) -> tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size); the scheduler looks up as rank 0."""
    if not worker:
        return 0, 0, 0, 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp, pp = get_tp_group(), get_pp_group()
        return tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size
    except Exception:  # not initialised (single process tests): rank 0 of 1
        return 0, 0, 0, 0


def engine_namespace(
    vllm_config: Any, kv_cache_config: Any, salt: str, *, worker: bool
) -> EngineNamespace:
    """Everything that changes the KV bytes, derived identically in both processes.

    The layout comes from ``kv_cache_config`` (both halves get the same one) and
    the platform, never from tensors only the worker sees, so the scheduler's
    lookups use the worker's keys.
    """
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ConfigError("kvstore supports one KV-cache group (no hybrid attention models yet)")
    layout = [f"block{cc.block_size}"]
    if groups:
        spec = groups[0].kv_cache_spec
        layout += [type(spec).__name__, f"layers{len(groups[0].layer_names)}"]
        for attr in ("num_kv_heads", "head_size", "head_size_v", "page_size_bytes"):
            if hasattr(spec, attr):
                layout.append(f"{attr}={getattr(spec, attr)}")
    layout.append(os.environ.get("VLLM_KV_CACHE_LAYOUT", ""))
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    tp_rank, tp_size, pp_rank, pp_size = _ranks(worker)
    return EngineNamespace(
        Namespace(
            model=str(mc.model),
            revision=str(getattr(mc, "revision", None) or ""),
            dtype=dtype,
            layout="/".join(layout),
            device=str(current_platform.device_type),
            tp_rank=tp_rank,
            tp_size=tp_size or pc.tensor_parallel_size,
            pp_rank=pp_rank,
            pp_size=pp_size or pc.pipeline_parallel_size,
            salt=salt,
        )
    )


class Backend:
    """The SDK client, opened lazily, skipped for a while after any failure."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        engine_id: str,
        role: str,
        url: str = "",
        engine: EngineNamespace | None = None,
    ) -> None:
        """Without a url (given, or ``cfg.url``) this engine's private server is opened:
        ``engine`` (rank 0's namespace, the same in every process of the engine) picks
        the cache it last used."""
        self.cfg = cfg
        self.role = role
        self._server: PrivateServer | None = None
        if not (url or cfg.url):
            ns = engine.fingerprint.hex() if engine is not None else ""
            desc = engine.describe() if engine is not None else ""
            url, self._server = open_private(cfg, engine_id, ns, desc)
            if self._server is not None:
                atexit.register(self._stop_server)
        self.url = url or cfg.url
        self._client: Any = None
        self._down_until = 0.0
        self._last_warning = 0.0
        self._last_note = 0.0
        self._info: Any = None
        self._closed = False
        self._lock = threading.RLock()  # _connect and failed may race with close
        # Called with the client just before a failure closes it (Saves waits there for
        # device copies into that client's reservations).
        self.before_close: Callable[[Any], None] | None = None

    def sibling(self, role: str) -> Backend:
        """A Backend with its own client to the same server, for another thread: a
        failure there closes only that client, never one this thread is reading with."""
        return Backend(self.cfg, engine_id="", role=role, url=self.url)

    # -- connection ------------------------------------------------------------
    def _connect(self) -> Any:
        if self._client is not None:
            return self._client
        with self._lock:
            return self._connect_locked()

    def _connect_locked(self) -> Any:
        if self._client is not None:
            return self._client
        if self._closed or time.monotonic() < self._down_until:
            return None
        from kvstore.client import Client

        try:
            client = Client(
                self.url,
                token=self.cfg.auth_token or None,
                timeout=self.cfg.timeout_ms / 1000,
                shm=self.cfg.shm_flag,
            )
            self._info = client.info(timeout=self.cfg.timeout_ms / 1000)
        except Exception as e:
            self.failed("connect", e)
            return None
        if self._client is None and time.monotonic() >= self._down_until:
            log.info(
                "kvstore %s: connected to %s (shared memory: %s)",
                self.role,
                self.url,
                getattr(client, "shm_active", False),
            )
        self._client = client
        return client

    def failed(self, what: str, error: BaseException) -> None:
        """Count a failure: back off, reconnect later, warn at most every few seconds."""
        with self._lock:
            self._failed_locked(what, error)

    def _failed_locked(self, what: str, error: BaseException) -> None:
        now = time.monotonic()
        self._down_until = now + self.cfg.retry_after_ms / 1000
        if now - self._last_warning > 5:
            self._last_warning = now
            log.warning(
                "kvstore %s: %s via %s failed (%s: %s); computing instead, retrying in %d ms",
                self.role,
                what,
                self.url,
                type(error).__name__,
                error,
                self.cfg.retry_after_ms,
            )
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                if self.before_close is not None:
                    self.before_close(client)
                client.close()

    def chunk_tokens(self, block_size: int) -> int:
        client = self._connect()
        served = int(getattr(self._info, "chunk_tokens", 0) or 0) if client else 0
        chunk = self.cfg.chunk_tokens or served or DEFAULT_CHUNK_TOKENS
        if served and chunk != served:
            raise ConfigError(
                f"kv_connector_extra_config.chunk_tokens={chunk} but the server at "
                f"{self.url} chunks by {served}; drop the setting or match it"
            )
        if chunk % block_size:
            raise ConfigError(
                f"chunk_tokens={chunk} is not a multiple of the block size "
                f"{block_size}; start kvstore-server with --chunk-tokens "
                f"{block_size * max(1, chunk // block_size)}"
            )
        return chunk

    # -- calls (each degrades to a miss) -----------------------------------------
    def lookup(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        *,
        min_tokens: int = 0,
        granularity: int = 0,
        worker: bool = False,
    ) -> LookupResult | None:
        client = self._connect()
        if client is None:
            return None
        timeout = (self.cfg.timeout_ms if worker else self.cfg.lookup_timeout_ms) / 1000
        try:
            return client.lookup(
                ns,
                tokens,
                min_tokens=min_tokens,
                granularity=granularity,
                repeat=worker,  # the scheduler counted this request's lookup
                timeout=timeout,
            )
        except Exception as e:
            self.failed("lookup", e)
            return None

    def get_into(self, key: ChunkKey, out: Any) -> RecordHeader | None:
        client = self._connect()
        if client is None:
            return None
        try:
            return client.get_into(key, out.numpy())
        except Exception as e:
            self.failed("load", e)
            return None

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        client = self._connect()
        if client is None or not keys:
            return [True] * len(keys)  # down: do not try to save
        try:
            return [bool(t) for t in client.exists(keys)]
        except Exception as e:
            self.failed("exists", e)
            return [True] * len(keys)

    def reserve(self, headers: Sequence[RecordHeader]) -> list[Any] | None:
        """Arena space to write saves in place (``Client.reserve``, checksums left to the
        server), or None: no shared memory with this server, or it is down."""
        client = self._connect()
        if client is None or not client.shm_active:
            return None
        try:
            return list(client.reserve(headers))
        except Exception as e:
            self.failed("save", e)
            return None

    def commit(self, reservation: Any, checksum: int | None = None) -> bool:
        if reservation.arena.closed:
            return False  # made by a client closed since (a reconnect): nothing to commit
        try:
            return bool(reservation.commit(checksum).ok)
        except Exception as e:
            if not reservation.arena.closed:  # else closing the new client would not help
                self.failed("save", e)
            return False

    def commit_many(
        self, reservations: Sequence[Any], checksums: Sequence[int | None]
    ) -> list[bool]:
        """Commit a step's reservations in one round trip; which were stored."""
        client = self._client
        if client is None:
            return [False] * len(reservations)
        # Reservations of a client closed since are gone with it: nothing to commit.
        mine = [
            i for i, r in enumerate(reservations) if r.arena is client.arena and not r.arena.closed
        ]
        out = [False] * len(reservations)
        try:
            got = client.commit([reservations[i] for i in mine], [checksums[i] for i in mine])
        except Exception as e:
            self.failed("save", e)
            return out
        for i, status in zip(mine, got, strict=True):
            out[i] = bool(getattr(status, "ok", False))
            if isinstance(status, Exception):  # this chunk only: the connection is fine
                self._note(
                    f"save of one chunk ({type(status).__name__}: {status}); "
                    "it will be recomputed when needed"
                )
        return out

    def _note(self, message: str) -> None:
        """A warning about one operation, at most one every 5 s per process."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_note <= 5:
                return
            self._last_note = now
        log.warning("kvstore %s: %s", self.role, message)

    def put(self, header: RecordHeader, payload: Any) -> bool:
        client = self._connect()
        if client is None:
            return False
        try:
            status = client.put(header, payload)
        except Exception as e:
            self.failed("save", e)
            return False
        return bool(status.ok)

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a late call (a saver thread past its drain) stays closed
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        self._stop_server()

    def _stop_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()
