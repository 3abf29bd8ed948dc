"""The connector's client: the SDK's ``Client``, opened lazily, behind a circuit breaker.

A failure to reach the server (``ServerUnavailable``: refused, reset, shutting down;
``DeadlineExceeded``: too slow) opens ``kvstore.retry.CircuitBreaker``: the client is
closed and for ``retry_after_ms`` no call dials the server (each degrades to a miss at
no cost), then one call tries to connect again. Anything else a call raises (a bug in
the connector or the SDK, a bad argument, a record the server refuses) says nothing
about the connection: it is logged with its traceback (at most one every 5 s per
client) and counted (``errors`` in the connector's stats), that request computes
instead, and the cache stays on for every other request.

Without a url, ``open_client`` opens the engine's private server first (``vllm_private``).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from vllm.logger import init_logger

from kvstore.clock import Clock, monotonic
from kvstore.errors import ConfigError, DeadlineExceeded, ServerUnavailable
from kvstore.keys import ChunkKey, Namespace
from kvstore.records import RecordHeader
from kvstore.retry import CircuitBreaker
from kvstore.sdk import LeaseBase, LentLease
from kvstore.types import LookupResult

from .vllm_config import ConnectorConfig
from .vllm_namespace import EngineNamespace
from .vllm_private import PrivateServer, open_private

log = init_logger("vllm.kvstore.connector")

DEFAULT_CHUNK_TOKENS = 256
# The failures that say the server cannot be reached (now): only these open the breaker.
CONNECTION_FAILURES: tuple[type[BaseException], ...] = (ServerUnavailable, DeadlineExceeded)
_LOG_EVERY_S = 5.0  # at most one line per kind of failure per client this often


def open_client(
    cfg: ConnectorConfig,
    *,
    engine_id: str,
    role: str,
    engine: EngineNamespace,
    clock: Clock = monotonic,
    cpus: frozenset[int] | None = None,
) -> BreakerClient:
    """The client of one process: to ``cfg.url``, or to this engine's private server,
    started here if no other process of the engine has started it yet. ``engine`` (rank
    0's namespace, the same in every process of the engine) picks the cache it last used.
    ``cpus``: where a private server started here runs (``open_private``)."""
    if cfg.url:
        return BreakerClient(cfg, cfg.url, role=role, clock=clock)
    url, server = open_private(
        cfg, engine_id, engine.fingerprint.hex(), engine.describe(), cpus=cpus
    )
    return BreakerClient(cfg, url, role=role, server=server, clock=clock)


class Leased(NamedTuple):
    """What one AcquireMany lent: per key a ``Lease``, ``USE_GET`` or None, and the client
    that holds the leases (released through it, and only while it is open)."""

    client: Any
    items: list[Any]
    drop: tuple[bytes, ...] = ()  # chunks dropped in the Release that ends the leases


class BreakerClient:
    """One ``Client`` to one server, reconnected after the breaker's cooldown; every call
    degrades to a miss (None, False, ...) instead of raising."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        url: str,
        *,
        role: str,
        server: PrivateServer | None = None,
        clock: Clock = monotonic,
    ) -> None:
        """``server``: a private server this process started, stopped with the client."""
        self.cfg, self.url, self.role = cfg, url, role
        self._clock = clock
        # One failure opens it, as a second deadline in the same step would cost as much
        # again; the breaker wants a cooldown > 0, so retry_after_ms=0 becomes 1 ms.
        self.breaker = CircuitBreaker(1, max(1, cfg.retry_after_ms), clock=clock)
        self._server = server
        if server is not None:
            atexit.register(self._stop_server)
        self._client: Any = None
        self._info: Any = None
        self._closed = False
        self._errors = 0  # calls that raised something other than a connection failure
        self._last_log: dict[str, float] = {}
        self._lock = threading.RLock()  # _connect and failed may race with close
        # Called with the client just before a failure closes it and unmaps its arena
        # (Saves waits there for device copies into its reservations, Loads for copies
        # out of its leases).
        self.before_close: list[Callable[[Any], None]] = []

    def sibling(self, role: str) -> BreakerClient:
        """A client of its own to the same server, with its own breaker, for another
        thread: a failure there closes only that client, never one this thread reads with."""
        return BreakerClient(self.cfg, self.url, role=role, clock=self._clock)

    # -- connection ------------------------------------------------------------
    def _connect(self) -> Any:
        if self._client is not None:
            return self._client
        with self._lock:
            return self._connect_locked()

    def _connect_locked(self) -> Any:
        if self._client is not None:
            return self._client
        if self._closed or not self.breaker.allow():
            return None
        from kvstore.sdk import Client

        client = None
        try:
            client = Client(
                self.url,
                token=self.cfg.auth_token or None,
                timeout=self.cfg.timeout_ms / 1000,
                shm=self.cfg.shm_flag,
            )
            self._info = client.info(timeout=self.cfg.timeout_ms / 1000)
        except Exception as e:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
            if not isinstance(e, CONNECTION_FAILURES):
                self.breaker.record_success()  # it answered: this trial is over
            self.failed("connect", e)
            return None
        self.breaker.record_success()
        log.info(
            "kvstore %s: connected to %s (shared memory: %s)",
            self.role,
            self.url,
            getattr(client, "shm_active", False),
        )
        self._client = client
        return client

    def failed(self, what: str, error: BaseException) -> None:
        """Report a call that raised: a connection failure opens the breaker (and closes
        the client); anything else is logged with its traceback and counted in ``errors``."""
        if isinstance(error, CONNECTION_FAILURES):
            with self._lock:
                self._lost(what, error)
            return
        with self._lock:
            self._errors += 1
            loud = self._due("error")
        if loud:
            log.error(
                "kvstore %s: %s via %s raised %s: %s; this request computes instead. Not a "
                "connection failure, so the cache stays on (counted in errors)",
                self.role,
                what,
                self.url,
                type(error).__name__,
                error,
                exc_info=error,
            )

    def _lost(self, what: str, error: BaseException) -> None:
        self.breaker.record_failure(error)
        if self._due("lost"):
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
                for settle in self.before_close:
                    settle(client)
                client.close()

    def _due(self, kind: str) -> bool:
        """Whether a line of this kind may be logged now (rate limit). Caller holds _lock."""
        now = self._clock()
        last = self._last_log.get(kind)
        if last is not None and now - last <= _LOG_EVERY_S:
            return False
        self._last_log[kind] = now
        return True

    def take_errors(self) -> int:
        """Calls that raised something other than a connection failure, since the last call."""
        with self._lock:
            n, self._errors = self._errors, 0
            return n

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
        prefetch: bool = False,
        reads_disk: bool = False,
    ) -> LookupResult | None:
        """``prefetch``: the server starts promoting the matched chunks below L1 into L1
        (``reads_disk``: only those below L2, the workers reading L2's in place)."""
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
                prefetch=prefetch,
                reads_disk=reads_disk,
                timeout=timeout,
            )
        except Exception as e:
            self.failed("lookup", e)
            return None

    def lookup_lend(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        *,
        lend_from: int,
        holder: str,
        min_tokens: int = 0,
        granularity: int = 0,
        prefetch: bool = False,
        reads_disk: bool = False,
    ) -> tuple[LookupResult, list[LentLease | None]] | None:
        """``lookup``, the matched chunks from token ``lend_from`` on lent in the same
        call to session ``holder`` (``Client.lookup_lend``), for the worker that loads
        them next (``adopt``)."""
        client = self._connect()
        if client is None:
            return None
        try:
            return client.lookup_lend(
                ns,
                tokens,
                lend_from=lend_from,
                holder=holder,
                min_tokens=min_tokens,
                granularity=granularity,
                prefetch=prefetch,
                reads_disk=reads_disk,
                timeout=self.cfg.lookup_timeout_ms / 1000,
            )
        except Exception as e:
            self.failed("lookup", e)
            return None

    def release_lent(self, lent: Sequence[LentLease]) -> None:
        """End, not waited for, leases a lookup lent that no load takes."""
        client = self._client if lent else None
        if client is None:
            return  # closed since: a server out of reach; they run out (lease_ms)
        try:
            client.release_lent(lent)
        except Exception as e:
            self.failed("release", e)

    def adopt(self, lent: Sequence[LentLease]) -> list[Any] | None:
        """Leases the scheduler's lookup lent, as leases of this client (a ``Lease``, or
        None where it cannot read one: acquire that chunk); None when the call failed."""
        client = self._connect()
        if client is None:
            return None
        try:
            return list(client.adopt(lent))
        except Exception as e:
            self.failed("load", e)
            return None

    def shm_active(self) -> bool:
        """Chunk bytes travel through the server's arena (connected, on its host)."""
        client = self._connect()
        return bool(client is not None and client.shm_active)

    def acquire_many(
        self, keys: Sequence[ChunkKey], timeout_s: float | None = None, *, disk: bool = False
    ) -> Leased | None:
        """Read leases on many chunks in one AcquireMany (``Client.acquire_many``: per key
        a ``Lease``, ``USE_GET`` or None), the client verifying each payload as it is
        copied; None when the call failed (the server is down: every chunk is a miss).
        ``disk``: chunks only in L2 may be lent where they lie in L2's file."""
        client = self._connect()
        if client is None:
            return None
        if not keys:
            return Leased(client, [])
        timeout = self.cfg.timeout_ms / 1000 if timeout_s is None else timeout_s
        try:
            got = client.acquire_many(keys, verify=True, timeout=max(timeout, 0.001), disk=disk)
        except Exception as e:
            self.failed("load", e)
            return None
        return Leased(client, list(got))

    def release_later(self, leased: Leased) -> None:
        """End a batch's leases with one Release that nobody waits for (their bytes were
        verified as they were copied, so one that ran out meanwhile served no wrong KV),
        dropping ``leased.drop`` in the same call."""
        leases = [x for x in leased.items if isinstance(x, LeaseBase) and not x.released]
        if leased.client is not self._client or leased.client.arena is None:
            # That client was closed since: the server dropped its leases with it, but not
            # those lent to another holder (the scheduler's lookup's): ended from here.
            lent = [x for x in leases if x.holder]
            if lent and self._client is not None:
                try:
                    self._client.release_later(lent)
                except Exception as e:
                    self.failed("release", e)
            self.drop_later(leased.drop)
            return
        if not leases and not leased.drop:
            return
        try:
            leased.client.release_later(leases, drop=leased.drop)
        except Exception as e:
            self.failed("release", e)

    def drop_later(self, keys: Sequence[bytes]) -> None:
        """Drop chunks this engine loaded (drop_after_load) with one Release that nobody
        waits for: deleted from every tier, or once the last lease on them ends."""
        client = self._connect() if keys else None
        if client is None:
            return  # the server is out of reach: the chunks age out as any other
        try:
            client.release_later([], drop=keys)
        except Exception as e:
            self.failed("release", e)

    def get_into(
        self, key: ChunkKey, out: Any, timeout_s: float | None = None
    ) -> RecordHeader | None:
        client = self._connect()
        if client is None:
            return None
        timeout = self.cfg.timeout_ms / 1000 if timeout_s is None else max(timeout_s, 0.001)
        try:
            return client.get_into(key, out.numpy(), timeout=timeout)
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
        """A warning about one operation, rate limited like the others."""
        with self._lock:
            if not self._due("note"):
                return
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
