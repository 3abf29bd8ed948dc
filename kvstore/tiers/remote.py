"""L3: Redis or Valkey, standalone or cluster; sharing KV across hosts.

URLs: ``redis://``, ``rediss://`` and ``unix://`` use the ``redis`` client,
``valkey://`` and ``valkeys://`` the ``valkey`` client; ``?cluster=1`` (or
``cluster=true``) selects the cluster client. kvstore's own query parameters are
removed before the URL reaches the client library.

Keys, all under ``{prefix}:`` (hex in key names so operators can read them;
raw 32-byte keys as set members and hash fields, to keep them small):

    c:<key>           string  the whole record: packed header + payload in config.codec
    k:<parent>        hash    child key -> child's token ids (u32le); for partial matching
    k:<ROOT>.<fp>     hash    the same for first chunks: ROOT is shared by every
                              namespace, so its children are kept per namespace
    n:<fp>            set     chunk keys of one namespace (clear and scan by namespace)
    sz                hash    chunk key -> record bytes; HLEN is the chunk count
    used              string  sum of record bytes (INCRBY / DECRBY)
    lru               zset    chunk key -> last access (wall seconds); only when capacity_bytes > 0
    pin               set     pinned chunk keys

Consistency. The record is one atomic ``SET NX``; its bookkeeping follows in a
non-transactional pipeline (idempotent: whoever creates the ``sz`` entry adds to
``used``) and is removed after the record on delete/clear/evict. It is best
effort: hosts write it concurrently without locks, and a lost reply or a crash
between the steps can leave an entry behind or the counter off; ``recount()``
repairs the counter (eviction runs it when the numbers do not add up). Readers
never trust bookkeeping over the record: ``get`` verifies the record, ``scan``
skips (and prunes) entries whose record is gone, and a ``children`` entry whose
record is gone is just a miss when fetched. A put costs 3 round trips (4 with a
capacity); get, contains and children cost one.

Cluster mode uses no hash tags: every command touches exactly one key, pipelines
are never transactional, so records spread over all nodes while each
bookkeeping key lives on whichever node owns its slot. With a node down, records
on other nodes are still served; calls that need the missing node fail, count
towards the one circuit breaker of the tier, and degrade as below.

Capacity. With ``capacity_bytes > 0`` kvstore enforces it: ``put`` reads ``used``
and evicts the least recently used unpinned chunks (``lru``), handing each to
``on_evict`` first. Accesses are buffered locally and flushed to ``lru`` in
batches (before every eviction), so ``get`` stays one round trip. Several
writers may overshoot the limit briefly. With ``capacity_bytes == 0`` there is
no kvstore-side limit: set ``maxmemory`` with ``maxmemory-policy allkeys-lru``
on the server; it then evicts records without telling us, so ``used``/``chunks``
are upper bounds until ``scan`` prunes them, and pinning has no effect there.

Failures. Every call has a deadline (socket timeouts from timeout_ms and
connect_timeout_ms; the client libraries' own retries are off), goes through
``Retry`` and then the ``CircuitBreaker``. While the breaker is open nothing
touches the network. Degrading methods (the read path and put, so the store keeps
serving from L1/L2): ``get`` -> None (a miss), ``put`` -> UNAVAILABLE (FULL when
the server is out of memory), ``contains`` -> all False, ``children`` -> {},
``stats`` -> last known numbers with healthy=False. Raising methods (the caller
asked for a change or a listing it must know happened): ``delete``, ``clear``,
``pin`` and ``scan`` raise TierUnavailable (remote down or breaker open) or
TierError (the server refused), chained to the client's exception.

Refusals (an error reply: WRONGTYPE, NOREPLICAS, READONLY, NOPERM) are not
outages and leave the breaker alone, so reads go on; they are counted, logged
(rate-limited) and make the tier degraded, and puts that keep being refused
open a write breaker of their own (kvstore.tiers.remote_guard).

Authentication. With ``auth_key_file`` every record written carries an HMAC
trailer, and a record read without a valid one is a counted (``corrupt`` and
``forged``), deleted miss. Without it trailers are ignored. Bookkeeping keys
are not authenticated: a planted ``k:`` or ``n:`` entry can make a lookup
promise a chunk whose get then misses, never serve its bytes.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from kvstore.clock import Clock, monotonic
from kvstore.config import RemoteConfig
from kvstore.errors import ConfigError, CorruptRecord, InvalidArgument, TierError, TierUnavailable
from kvstore.keys import KEY_BYTES, ROOT, ChunkKey, Fingerprint, chunk_key
from kvstore.records import Codec, RecordHeader, parse_header, transcode_parts
from kvstore.retry import BreakerState, CircuitBreaker, Retry
from kvstore.tiers.base import ChunkInfo, Tier
from kvstore.tiers.remote_client import client_classes, parse_url, redact
from kvstore.tiers.remote_guard import (
    ForgedRecord,
    RateLimitedLog,
    RecordSeal,
    Refusals,
    Refused,
    open_value,
)
from kvstore.types import PutStatus, TierLevel, TierStats

T = TypeVar("T")

HEAD_GUESS = 4096  # first GETRANGE size for headers: covers chunks of up to ~1000 tokens
BATCH = 256  # keys per pipeline in scans, clears and evictions
TOUCH_FLUSH = 64  # buffered LRU touches that trigger a flush
_HEX_KEY = re.compile(rb"[0-9a-f]{%d}" % (2 * KEY_BYTES))


class RemoteTier(Tier):
    """Redis/Valkey tier. See the module docstring for layout, capacity and failures."""

    name = TierLevel.REMOTE.label
    level = TierLevel.REMOTE

    def __init__(
        self,
        config: RemoteConfig,
        *,
        clock: Clock = monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wall: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        if not config.url:
            raise ConfigError("remote.url is empty: the remote tier is off")
        self.config = config
        self.flavor, self.cluster, self._client_url = parse_url(config.url)
        self.codec = Codec.parse(config.codec)
        (self._cls, self._lib_retry, self._down, self._backend, self._oom) = client_classes(
            self.flavor, self.cluster
        )
        self._retry = Retry.from_config(config, sleep=sleep, retry_on=self._down)
        self._breaker = CircuitBreaker.from_config(config, clock=clock)
        self._wall = wall
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._touch_lock = threading.Lock()
        self._touches: dict[bytes, float] = {}
        self._counts = TierStats(self.name, self.level, config.capacity_bytes)
        self._skipped = 0  # calls refused by the open breaker
        self._refusals = Refusals(config, f"remote {redact(config.url)}", clock=clock)
        key = config.auth_key()
        self._seal = RecordSeal(key) if key is not None else None
        self._forged = 0  # records refused for want of a valid MAC (also counted as corrupt)
        self._forged_log = RateLimitedLog(clock=clock)
        p = config.prefix
        self._p, self._sz, self._used = p, f"{p}:sz", f"{p}:used"
        self._lru, self._pin = f"{p}:lru", f"{p}:pin"
        try:  # find out now whether the remote is there, but never fail construction
            self._call("connect", lambda c: c.ping())
        except TierError as e:
            self._breaker.trip(e.__cause__ or e)

    # -- key names --------------------------------------------------------------
    def _c(self, key: bytes) -> str:
        return f"{self._p}:c:{key.hex()}"

    def _k(self, parent: bytes, fingerprint: bytes) -> str:
        if parent == ROOT:
            return f"{self._p}:k:{parent.hex()}.{fingerprint.hex()}"
        return f"{self._p}:k:{parent.hex()}"

    def _n(self, fingerprint: bytes) -> str:
        return f"{self._p}:n:{fingerprint.hex()}"

    # -- the one way to the network ------------------------------------------
    def _connect(self) -> Any:
        with self._client_lock:
            if self._client is None:
                kwargs: dict[str, Any] = {
                    "socket_timeout": self.config.timeout_ms / 1000,
                    "socket_connect_timeout": self.config.connect_timeout_ms / 1000,
                    "retry": self._lib_retry,
                }
                if self.cluster and self.flavor == "valkey":
                    kwargs["cluster_error_retry_attempts"] = 0
                # A cluster client connects here (slot discovery), so this can fail.
                self._client = self._cls.from_url(self._client_url, **kwargs)
            return self._client

    def _call(self, op: str, fn: Callable[[Any], T], *, retry: bool = True) -> T:
        """fn(client) under deadline, retry and breaker; backend errors become TierError.

        ``retry=False`` for calls that are not idempotent (INCRBY, or a removal
        whose replies decide what to decrement): a retry after a lost reply would
        apply them twice.
        """
        self._check_open()
        try:
            return self._breaker.call(
                lambda: fn(self._connect()),
                retry=self._retry if retry else None,
                failure_on=self._down,
                name=f"remote {redact(self.config.url)}",
            )
        except TierUnavailable:
            with self._stats_lock:
                self._skipped += 1
            raise
        except self._down as e:
            self._count(errors=1)
            raise TierUnavailable(f"remote {op} failed: {type(e).__name__}: {e}") from e
        except self._backend as e:
            self._count(errors=1)
            self._refusals.saw(op, e)
            raise Refused(f"remote {op} refused: {type(e).__name__}: {e}") from e

    def _cmd(self, op: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """One command, e.g. ``self._cmd("get", "get", name)``, through ``_call``."""
        return self._call(op, lambda c: getattr(c, method)(*args, **kwargs))

    def _pipe(self, op: str, cmds: Sequence[tuple[Any, ...]], *, retry: bool = True) -> list[Any]:
        """One round trip: each ``(method, *args)`` queued on a pipeline; results in order.

        Never transactional; a cluster pipeline splits the commands by node.
        """

        def run(client: Any) -> list[Any]:
            pipe = client.pipeline() if self.cluster else client.pipeline(transaction=False)
            for method, *args in cmds:
                getattr(pipe, method)(*args)
            return list(pipe.execute())

        return self._call(op, run, retry=retry) if cmds else []

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._counts, name, getattr(self._counts, name) + delta)

    # -- writes -------------------------------------------------------------------
    def put(self, header: RecordHeader, payload: bytes | memoryview) -> PutStatus:
        self._check_open()
        if not self._refusals.write_allowed():  # writes keep being refused: skip, unencoded
            self._count(rejected=1)
            return PutStatus.UNAVAILABLE
        parts: tuple[bytes | memoryview, ...]
        if header.codec == self.codec:
            parts = (header.pack(), payload)
        else:
            parts = (transcode_parts(header, payload, self.codec, self.config.level),)
        if self._seal is not None:
            parts = (*parts, self._seal.trailer(parts))
        blob = b"".join(parts)
        size, key, cap = len(blob), header.key, self.config.capacity_bytes
        if cap and size > cap:
            self._count(rejected=1)
            return PutStatus.TOO_LARGE
        try:
            if cap:
                exists, used = self._pipe("put", [("exists", self._c(key)), ("get", self._used)])
                if exists:
                    return PutStatus.EXISTS
                used = max(0, self._byte_count(used))
                if used + size > cap and not self._make_room(used, size):
                    self._count(rejected=1)
                    return PutStatus.FULL
            lost_reply = False

            def set_nx(client: Any) -> Any:
                nonlocal lost_reply
                try:
                    return client.set(self._c(key), blob, nx=True)
                except self._down:
                    lost_reply = True
                    raise

            if not self._call("put", set_nx):
                if lost_reply:  # our first try may have landed: make sure it is booked
                    self._book(header, size)
                self._refusals.write_accepted()
                return PutStatus.EXISTS
            try:
                self._book(header, size)
            except TierError:
                # A record without bookkeeping would never be evicted or counted:
                # take it back (best effort) and report the write as not done.
                with contextlib.suppress(TierError):
                    self._remove([(key, header)])
                raise
        except TierError as e:
            self._count(rejected=1)
            if isinstance(e.__cause__, self._oom):
                return PutStatus.FULL  # maxmemory reached with a noeviction policy
            if isinstance(e, Refused):
                self._refusals.write_refused(e)
            return PutStatus.UNAVAILABLE  # the store keeps the copy for later, either way
        self._refusals.write_accepted()
        self._count(puts=1, bytes_in=size)
        return PutStatus.STORED

    def _byte_count(self, value: Any) -> int:
        """``used`` as read from the server; a value we did not write is a refusal."""
        try:
            return int(value or 0)
        except ValueError:
            e = ValueError(f"{self._used} holds {bytes(value)[:32]!r}, not a byte count")
            self._count(errors=1)
            self._refusals.saw("put", e)
            raise Refused(f"remote put refused: {e}") from e

    def _book(self, header: RecordHeader, size: int) -> None:
        """Write a stored record's bookkeeping. Idempotent: only a new ``sz`` entry counts."""
        key = header.key
        cmds: list[tuple[Any, ...]] = [
            ("hsetnx", self._sz, key, size),
            ("hset", self._k(header.parent, header.fingerprint), key, header.token_bytes),
            ("sadd", self._n(header.fingerprint), key),
        ]
        if self.config.capacity_bytes:
            cmds.append(("zadd", self._lru, {key: self._wall()}, True))  # NX: keep a newer access
        if self._pipe("put", cmds)[0]:
            self._pipe("put", [("incrby", self._used, size)], retry=False)

    def delete(self, key: ChunkKey) -> bool:
        self._check_open()
        header = self._read_headers([key])[0]
        return self._remove([(key, header)])[0] > 0

    def clear(self, fingerprint: bytes | None = None) -> int:
        self._check_open()
        with self._touch_lock:
            self._touches.clear()
        if fingerprint is None:
            # Only our own key shapes, so a deployment with prefix "kvs:x" survives ours.
            # (SCAN still returns every key present all along when keys vanish meanwhile.)
            removed, chunk_prefix = 0, f"{self._p}:c:".encode()
            for some in _batched(self._scan_names(f"{self._p}:[ckn]:*")):
                done = self._pipe("clear", [("delete", n) for n in some])
                removed += sum(
                    1 for n, d in zip(some, done, strict=True) if d and n.startswith(chunk_prefix)
                )
            fixed = (self._sz, self._used, self._lru, self._pin)
            self._pipe("clear", [("delete", k) for k in fixed])
            return removed
        members = self._cmd("clear", "smembers", self._n(fingerprint))
        removed = 0
        for batch in _batched(ChunkKey(bytes(m)) for m in members):
            headers = self._read_headers(batch)
            removed += self._remove(list(zip(batch, headers, strict=True)))[0]
            # Every child of a chunk of this namespace is in this namespace too.
            self._pipe("clear", [("delete", self._k(k, fingerprint)) for k in batch])
        self._pipe(
            "clear", [("delete", self._n(fingerprint)), ("delete", self._k(ROOT, fingerprint))]
        )
        return removed

    def pin(self, key: ChunkKey, pinned: bool = True) -> bool:
        self._check_open()
        if not self._cmd("pin", "exists", self._c(key)):
            return False
        self._cmd("pin", "sadd" if pinned else "srem", self._pin, key)
        return True

    def _remove(self, items: Sequence[tuple[ChunkKey, RecordHeader | None]]) -> tuple[int, int]:
        """Delete records and their bookkeeping; (records deleted, bytes freed)."""
        if not items:
            return 0, 0

        first: list[tuple[Any, ...]] = []
        for key, _ in items:
            first += [("hget", self._sz, key), ("delete", self._c(key)), ("hdel", self._sz, key)]
        res = self._pipe("delete", first, retry=False)
        deleted = freed = 0
        for i in range(len(items)):
            size, gone, unbooked = res[3 * i : 3 * i + 3]
            deleted += int(gone)
            if unbooked and size is not None:  # only whoever removed the entry decrements
                freed += int(size)

        keys = [k for k, _ in items]
        second: list[tuple[Any, ...]] = [("zrem", self._lru, *keys), ("srem", self._pin, *keys)]
        for key, header in items:
            if header is not None:
                second.append(("hdel", self._k(header.parent, header.fingerprint), key))
                second.append(("srem", self._n(header.fingerprint), key))
        if freed:
            second.append(("decrby", self._used, freed))
        self._pipe("delete", second, retry=False)
        return deleted, freed

    def recount(self) -> tuple[int, int]:
        """Recompute the byte counter from the ``sz`` hash; (chunks, bytes).

        The counter is kept with INCRBY/DECRBY by every host and can drift after
        lost replies or crashes; eviction calls this when the numbers stop adding up.
        """
        total = chunks = 0
        cursor = 0
        while True:
            cursor, page = self._cmd("recount", "hscan", self._sz, cursor, count=1000)
            chunks += len(page)
            total += sum(int(v) for v in page.values())
            if not cursor:
                break
        self._cmd("recount", "set", self._used, total)
        return chunks, total

    def _make_room(self, used: int, size: int) -> bool:
        """Evict LRU unpinned chunks until ``size`` more bytes fit; False if impossible."""
        self._flush_touches(raise_errors=True)
        cap = self.config.capacity_bytes
        recounted = used > cap  # never so with exact books: recount before evicting for it
        if recounted:
            used = self.recount()[1]
        need, freed, skip = used + size - cap, 0, 0
        for _ in range(10_000):  # bounded: a misbehaving server must not spin us forever
            if freed >= need:
                return True
            cands = [
                ChunkKey(bytes(k))
                for k in self._cmd("evict", "zrange", self._lru, skip, skip + BATCH - 1)
            ]
            if not cands:
                if recounted:
                    return False
                # Nothing left to evict yet still over: the counter may have drifted.
                recounted, (_, used) = True, self.recount()
                need, freed, skip = used + size - cap, 0, 0
                continue
            pinned = self._cmd("evict", "smismember", self._pin, cands)
            for key, is_pinned in zip(cands, pinned, strict=True):
                if is_pinned:
                    skip += 1
                elif freed < need:
                    freed += self._evict_one(key)
        return False

    def _evict_one(self, key: ChunkKey) -> int:
        blob = self._cmd("evict", "get", self._c(key))
        header: RecordHeader | None = None
        if blob is not None:
            try:
                header, record = open_value(blob, key, self._seal)
            except CorruptRecord as e:
                self._refuse(key, e)
                header = _header_or_none(blob)
            else:
                if self.on_evict is not None:
                    self.on_evict(key, header, bytes(record))
        deleted, freed = self._remove([(key, header)])
        if deleted and blob is not None:
            self._count(evictions=1)
        return freed

    # -- reads ----------------------------------------------------------------------
    def get(self, key: ChunkKey) -> bytes | None:
        self._check_open()
        try:
            blob = self._cmd("get", "get", self._c(key))
        except TierError as e:
            self._count(misses=1)
            if isinstance(e, Refused) and "WRONGTYPE" in str(e):
                # Not a string: something else's value under our record's name. No reader
                # could ever use it, and SET NX would never replace it.
                with contextlib.suppress(TierError):
                    self._remove([(key, None)])
                self._refuse(key, CorruptRecord(f"{self._c(key)} is not a string"))
            return None
        if blob is None:
            self._count(misses=1)
            return None
        try:
            _, record = open_value(blob, key, self._seal)
        except CorruptRecord as e:
            self._count(misses=1)
            with contextlib.suppress(TierError):  # else the next reader deletes it
                self._remove([(key, _header_or_none(blob))])
            self._refuse(key, e)
            return None
        self._count(hits=1, bytes_out=len(record))
        if self.config.capacity_bytes:
            self._touch(key)
        return bytes(blob) if len(record) == len(blob) else bytes(record)

    def _refuse(self, key: ChunkKey, error: CorruptRecord) -> None:
        """Count a record that failed verification, or came without a valid MAC."""
        self._count(corrupt=1)
        if isinstance(error, ForgedRecord):
            with self._stats_lock:
                self._forged += 1
            self._forged_log.warn(
                "forged",
                "remote %s: record %s refused: %s (written without this server's "
                "remote.auth_key_file key); deleted",
                redact(self.config.url),
                key.hex()[:16],
                error,
            )
        self._report_corrupt(key)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open()
        if not keys:
            return []
        try:
            found = self._pipe("contains", [("exists", self._c(k)) for k in keys])
        except TierError:
            return [False] * len(keys)
        return [bool(f) for f in found]

    def children(self, parent: ChunkKey, fingerprint: bytes | None = None) -> dict[ChunkKey, bytes]:
        """Stored children of ``parent``: child key -> its token ids (u32le bytes).

        ROOT's children are kept per namespace (ROOT is every namespace's parent),
        so ``fingerprint`` is required for ROOT. When given, entries whose key
        does not hash from (parent, fingerprint, tokens) are dropped: a child is
        never reported for another namespace. Degrades to {} when the remote is down.
        """
        self._check_open()
        if parent == ROOT and fingerprint is None:
            raise InvalidArgument("children(ROOT) needs the namespace fingerprint")
        try:
            raw = self._cmd("children", "hgetall", self._k(parent, fingerprint or b""))
        except TierError:
            return {}
        out: dict[ChunkKey, bytes] = {}
        for child, tokens in raw.items():
            if len(child) != KEY_BYTES or not tokens or len(tokens) % 4:
                continue
            if (
                fingerprint is not None
                and chunk_key(parent, Fingerprint(fingerprint), tokens) != child
            ):
                continue
            out[ChunkKey(bytes(child))] = bytes(tokens)
        return out

    def scan(self, fingerprint: bytes | None = None) -> Iterator[ChunkInfo]:
        self._check_open()
        return self._scan(fingerprint)

    def _scan(self, fingerprint: bytes | None) -> Iterator[ChunkInfo]:
        if fingerprint is None:
            cut = len(self._p) + 3  # names of other prefixes ("kvs:c:x") match too: skip them
            keys: Iterator[ChunkKey] = (
                ChunkKey(bytes.fromhex(n[cut:].decode()))
                for n in self._scan_names(f"{self._p}:c:*")
                if _HEX_KEY.fullmatch(n[cut:])
            )
        else:
            members = self._cmd("scan", "smembers", self._n(fingerprint))
            keys = (ChunkKey(bytes(m)) for m in members)
        for batch in _batched(keys):
            yield from self._scan_batch(batch, fingerprint)

    def _scan_batch(self, batch: list[ChunkKey], fingerprint: bytes | None) -> Iterator[ChunkInfo]:
        headers = self._read_headers(batch)
        pins = self._cmd("scan", "smismember", self._pin, batch)
        seen: list[float | None] = [None] * len(batch)
        if self.config.capacity_bytes:
            seen = self._cmd("scan", "zmscore", self._lru, batch)
        vanished: list[ChunkKey] = []
        for key, header, pinned, last in zip(batch, headers, pins, seen, strict=True):
            if header is None:
                vanished.append(key)
                continue
            last_ms = int(last * 1000) if last is not None else header.created_ms
            yield ChunkInfo(key, header, header.record_size, bool(pinned), last_ms)
        if vanished:
            self._prune(vanished, fingerprint)

    def _prune(self, keys: list[ChunkKey], fingerprint: bytes | None) -> None:
        """Drop bookkeeping of records that are gone (evicted by the server, say)."""
        with contextlib.suppress(TierError):
            exists = self._pipe("scan", [("exists", self._c(k)) for k in keys])
            gone = [k for k, e in zip(keys, exists, strict=True) if not e]
            self._remove([(k, None) for k in gone])
            if fingerprint is not None and gone:
                self._pipe("scan", [("srem", self._n(fingerprint), *gone)])

    def _read_headers(self, keys: Sequence[ChunkKey]) -> list[RecordHeader | None]:
        """Parsed headers (None: missing or unreadable), by GETRANGE: payloads stay remote."""
        out: list[RecordHeader | None] = [None] * len(keys)
        todo, size = list(range(len(keys))), HEAD_GUESS
        while todo:
            parts = self._pipe("read", [("getrange", self._c(keys[i]), 0, size - 1) for i in todo])
            again = []
            for i, part in zip(todo, parts, strict=True):
                try:
                    out[i] = parse_header(part, expect_key=keys[i])
                except CorruptRecord:
                    if len(part) == size:  # cut short: the header is longer than we read
                        again.append(i)
            todo, size = again, size * 8
        return out

    def _scan_names(self, pattern: str) -> Iterator[bytes]:
        """Key names matching ``pattern``, streamed with SCAN on every (primary) node."""
        if not self.cluster:
            cursor = 0
            while True:
                cursor, names = self._cmd("scan", "scan", cursor, match=pattern, count=1000)
                yield from names
                if not cursor:
                    return
        for node in self._cmd("scan", "get_primaries"):
            cursor = 0
            while True:
                cursors, names = self._cmd(
                    "scan", "scan", cursor, match=pattern, count=1000, target_nodes=node
                )
                yield from names
                cursor = cursors[node.name]
                if not cursor:
                    break

    # -- LRU touches ----------------------------------------------------------------
    def _touch(self, key: bytes) -> None:
        with self._touch_lock:
            self._touches[key] = self._wall()
            full = len(self._touches) >= TOUCH_FLUSH
        if full:
            self._flush_touches()

    def _flush_touches(self, raise_errors: bool = False) -> None:
        with self._touch_lock:
            touches, self._touches = self._touches, {}
        if not touches:
            return
        try:  # XX: never resurrect a removed chunk; GT: never move an access back in time
            self._cmd("touch", "zadd", self._lru, touches, xx=True, gt=True)
        except TierError:
            if raise_errors:
                raise

    # -- stats and lifecycle ----------------------------------------------------------
    @property
    def accepting(self) -> bool:
        return (
            self._breaker.state is not BreakerState.OPEN
            and self._refusals.writes.state is not BreakerState.OPEN
        )

    def stats(self) -> TierStats:
        if not self._closed:
            try:
                used, chunks = self._pipe("stats", [("get", self._used), ("hlen", self._sz)])
                with self._stats_lock:
                    self._counts.used_bytes = max(0, int(used or 0))
                    self._counts.chunks = int(chunks)
            except Exception:  # stats never fails: the last numbers stand, healthy says why
                pass
        state = self._breaker.snapshot()
        with self._stats_lock:
            snap = TierStats(**{**vars(self._counts), "detail": {}})
            refusals = self._refusals.detail()
            snap.healthy = (
                not self._closed
                and state["state"] == BreakerState.CLOSED.value
                and state["consecutive_failures"] == 0
                and not refusals["degraded"]
            )
            snap.detail = {
                **state,
                **refusals,
                "url": redact(self.config.url),
                "flavor": self.flavor,
                "cluster": self.cluster,
                "codec": self.codec.name.lower(),
                "prefix": self._p,
                "skipped": self._skipped,
                "closed": self._closed,
                "authenticated": self._seal is not None,  # whether records carry a MAC
                "forged": self._forged,
            }
        return snap

    def __enter__(self) -> RemoteTier:
        return self

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._breaker.state is BreakerState.CLOSED:
                self._flush_touches()
        finally:
            super().close()
            with self._client_lock:
                client, self._client = self._client, None
            if client is not None:
                with contextlib.suppress(Exception):  # a dead connection may fail to close
                    client.close()


def _batched(items: Iterable[T]) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _header_or_none(blob: bytes | memoryview) -> RecordHeader | None:
    """The header of a record whose payload may be corrupt (to clean its bookkeeping)."""
    try:
        return parse_header(blob)
    except CorruptRecord:
        return None
