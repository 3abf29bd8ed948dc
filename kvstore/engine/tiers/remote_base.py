"""The plumbing of the remote tier: the one way to the network, key names, record values
in and out (whole or in parts), removal. ``kvstore.engine.tiers.remote`` has the contract."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore.clock import Clock, monotonic
from kvstore.config import RemoteConfig
from kvstore.engine.tiers.base import Tier, copy_into
from kvstore.engine.tiers.remote_client import (
    client_classes,
    parse_sentinel,
    parse_url,
    redact,
    sentinel_primary,
)
from kvstore.engine.tiers.remote_guard import (
    ForgedRecord,
    RateLimitedLog,
    RecordSeal,
    Refusals,
    Refused,
    open_value,
)
from kvstore.engine.tiers.remote_parts import (
    Manifest,
    check,
    into_sink,
    manifest_value,
    parse_manifest,
    part_count,
    part_names,
    part_sink,
    spans,
    split,
    whole,
)
from kvstore.engine.tiers.remote_resp import RespError, RespOOM, Sink
from kvstore.engine.tiers.remote_values import LibraryPlane, ValuePlane
from kvstore.errors import ConfigError, CorruptRecord, TierError, TierUnavailable
from kvstore.keys import ROOT, SUBHASH_BYTES, ChunkKey, sub_hashes
from kvstore.records import Codec, RecordHeader, decode_payload, parse_header
from kvstore.retry import CircuitBreaker, Retry
from kvstore.types import TierLevel, TierStats

T = TypeVar("T")

TOUCH_FLUSH = 64  # buffered LRU touches that trigger a flush
# Ends a writer's claim on a record in parts only if it is still this writer's.
_UNCLAIM = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end"


def filing_fields(subhashes: bytes, granularity: int) -> list[bytes]:
    """The fields of ``_s``: one per unit, its cumulative sub-hash after the granularity
    (four bytes), so hosts of different granularities never read each other's."""
    tag = granularity.to_bytes(4, "little")
    return [
        tag + subhashes[i : i + SUBHASH_BYTES]
        for i in range(0, len(subhashes) - SUBHASH_BYTES + 1, SUBHASH_BYTES)
    ]


class RemoteBase(Tier):
    name = TierLevel.REMOTE.label
    level = TierLevel.REMOTE

    def __init__(
        self,
        config: RemoteConfig,
        *,
        clock: Clock = monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wall: Callable[[], float] = time.time,
        granularity: int = 16,
    ) -> None:
        super().__init__()
        # The store's: chunks are filed for partial matching by sub-hashes of this many
        # tokens, the units its lookups compare.
        self.granularity = granularity
        if not config.url:
            raise ConfigError("remote.url is empty: the remote tier is off")
        self.config = config
        self.flavor, self.cluster, self._client_url = parse_url(config.url)
        self.sentinel = parse_sentinel(config.url)
        self.codec = Codec.parse(config.codec)
        (self._cls, self._lib_retry, down, backend, oom) = client_classes(self.flavor, self.cluster)
        self._down: tuple[type[BaseException], ...] = down
        self._backend: tuple[type[BaseException], ...] = (*backend, RespError)
        self._oom: tuple[type[BaseException], ...] = (oom, RespOOM)
        self._retry = Retry.from_config(config, sleep=sleep, retry_on=self._down)
        self._breaker = CircuitBreaker.from_config(config, clock=clock)
        self._wall = wall
        self._timeout_s = config.timeout_ms / 1000
        # A claim outlives any writer that keeps its deadlines (the parts' stream and the
        # manifest); a writer that died lets it lapse.
        self._claim_ms = 3 * config.timeout_ms + 1000
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._touch_lock = threading.Lock()
        self._touches: dict[bytes, float] = {}
        self._counts = TierStats(self.name, self.level, config.capacity_bytes)
        self._skipped = 0  # calls refused by the open breaker
        self._torn = 0  # records in parts found with a part missing or cut (misses)
        self._refusals = Refusals(config, f"remote {redact(config.url)}", clock=clock)
        key = config.auth_key()
        self._seal = RecordSeal(key) if key is not None else None
        self._forged = 0  # records refused for want of a valid MAC (also counted as corrupt)
        self._forged_log = RateLimitedLog(clock=clock)
        p = config.prefix
        self._p, self._sz, self._used = p, f"{p}:sz", f"{p}:used"
        self._lru, self._pin = f"{p}:lru", f"{p}:pin"
        self._values: ValuePlane | LibraryPlane = self._value_plane()
        try:  # find out now whether the remote is there, but never fail construction
            self._call("connect", lambda c: c.ping())
        except TierError as e:
            self._breaker.trip(e.__cause__ or e)

    def _value_plane(self) -> ValuePlane | LibraryPlane:
        connect_s = self.config.connect_timeout_ms / 1000
        spec = self.sentinel
        if spec is not None:
            return ValuePlane(
                connect_s,
                spec.username,
                spec.password,
                spec.db,
                sentinel=lambda: sentinel_primary(self._connect()),
            )
        plane = ValuePlane.make(
            self._client_url, connect_s, cluster=self._connect if self.cluster else None
        )
        return plane if plane is not None else LibraryPlane(self._connect, self.cluster)

    # -- key names --------------------------------------------------------------
    def _c(self, key: bytes) -> str:
        return f"{self._p}:c:{key.hex()}"

    def _k(self, parent: bytes, fingerprint: bytes) -> str:
        if parent == ROOT:
            return f"{self._p}:k:{parent.hex()}.{fingerprint.hex()}"
        return f"{self._p}:k:{parent.hex()}"

    def _s(self, parent: bytes, fingerprint: bytes) -> str:
        """The children of ``parent`` in namespace ``fingerprint`` filed by prefix
        (``RemoteTier.siblings``). Per namespace under every parent, not only ROOT: a
        chunk of another namespace stored under this one's parent must not take over
        this namespace's fields."""
        return f"{self._p}:s:{parent.hex()}.{fingerprint.hex()}"

    def _filing(self, token_bytes: bytes) -> list[bytes]:
        """A chunk's fields in its family's ``_s`` hash: its sub-hash of every unit, after
        the granularity (a host of another granularity files and asks other fields)."""
        return filing_fields(sub_hashes(token_bytes, self.granularity), self.granularity)

    def _n(self, fingerprint: bytes) -> str:
        return f"{self._p}:n:{fingerprint.hex()}"

    # -- the one way to the network ------------------------------------------
    def _connect(self) -> Any:
        with self._client_lock:
            if self._client is None:
                kwargs: dict[str, Any] = {
                    "socket_timeout": self._timeout_s,
                    "socket_connect_timeout": self.config.connect_timeout_ms / 1000,
                    "retry": self._lib_retry,
                }
                if self.cluster and self.flavor == "valkey":
                    kwargs["cluster_error_retry_attempts"] = 0
                if self.sentinel is not None:
                    self._client = self.sentinel.client(kwargs)
                else:
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
            raise self._refused(op, e) from e

    def _refused(self, op: str, error: BaseException) -> Refused:
        self._count(errors=1)
        self._refusals.saw(op, error)
        return Refused(f"remote {op} refused: {type(error).__name__}: {error}")

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

    # -- record values ------------------------------------------------------------
    def _store(
        self,
        header: RecordHeader,
        head: bytes | memoryview,
        payload: memoryview,
        trailer: bytes | None,
        on_lost: Callable[[], None],
    ) -> bool:
        """Write a record's value (in parts first when it is big, the manifest last) with
        ``SET NX``; whether this call created it. ``on_lost`` runs when a try of the
        ``SET NX`` failed on the way (it may have landed)."""
        key, name = header.key, self._c(header.key)
        if not split(header):
            return self._set_nx(name, (head, payload, *((trailer,) if trailer else ())), on_lost)
        # Parts are named after the key alone, so writing them over a stored record would
        # tear it (another host storing the same chunk with other bytes: GPU kernels are
        # not bit-reproducible). The writer's claim and the check that no manifest exists
        # go first, in one round trip (the claim shares the manifest's slot).
        claim, nonce = self._claim_name(key), os.urandom(8).hex()
        first: list[tuple[tuple[str, ...], None]] = [
            (("SET", claim, nonce, "NX", "GET", "PX", str(self._claim_ms)), None),
            (("EXISTS", name), None),
        ]
        got = self._call("put", lambda _c: self._values.stream(claim, first, self._timeout_s))
        bad = next((r for r in got if isinstance(r, BaseException)), None)
        if bad is not None:
            raise self._refused("put", bad) from bad
        if got[0] not in (None, nonce.encode()):
            return False  # another writer is storing this chunk now
        try:
            if got[1]:
                return False  # stored already: its parts are not ours to rewrite
            names = part_names(self._p, key, part_count(header))
            cmds = [
                (("SET", n, payload[a:b]), None)
                for n, (a, b) in zip(names, spans(header.stored_size), strict=True)
            ]
            res = self._call("put", lambda _c: self._values.stream(names[0], cmds, self._timeout_s))
            bad = next((r for r in res if isinstance(r, BaseException)), None)
            if bad is not None:
                raise self._refused("put", bad) from bad
            return self._set_nx(name, manifest_value(bytes(head), header, trailer), on_lost)
        finally:
            unclaim = ("EVAL", _UNCLAIM, "1", claim, nonce)
            with contextlib.suppress(TierError):  # else it lapses after _claim_ms
                self._call("put", lambda _c: self._values.call(claim, unclaim, self._timeout_s))

    def _set_nx(
        self, name: str, value: tuple[bytes | memoryview, ...], on_lost: Callable[[], None]
    ) -> bool:
        def set_nx(_client: Any) -> Any:
            try:
                return self._values.call(name, ("SET", name, value, "NX"), self._timeout_s)
            except self._down:
                on_lost()
                raise

        return self._call("put", set_nx) == b"OK"

    def _claim_name(self, key: bytes) -> str:
        """The writer's claim on a record in parts, in the slot of its manifest (hash tag)."""
        return f"{self._p}:w:{{{self._c(key)}}}"

    def _read(self, op: str, key: ChunkKey, out: memoryview | None, *, count: bool = True) -> Any:
        """A verified record: with ``out`` its raw payload lands there and the header is
        returned, without it the whole record as bytes; None on a miss. A record that
        does not verify is deleted and counted, and is a miss."""
        name = self._c(key)
        sink: Sink[Any] = into_sink(key, out, self._seal) if out is not None else whole
        try:
            got = self._call(
                op, lambda _c: self._values.call(name, ("GET", name), self._timeout_s, sink)
            )
        except TierError as e:
            if isinstance(e, Refused) and "WRONGTYPE" in str(e):
                # Not a string: something else's value under our record's name. No reader
                # could ever use it, and SET NX would never replace it.
                with contextlib.suppress(TierError):
                    self._remove([(key, None)])
                self._refuse(key, CorruptRecord(f"{name} is not a string"))
            return self._miss(count)
        if got is None:
            return self._miss(count)
        if isinstance(got, CorruptRecord):
            return self._bad(key, None, got, count)
        if isinstance(got, RecordHeader):
            return self._hit(key, got, count)
        try:
            manifest = parse_manifest(got, key)
            if manifest is not None:
                return self._read_parts(op, key, manifest, out, count)
            header, record = open_value(got, key, self._seal)
            if out is None:
                return self._hit(key, header, count, bytes(record))
            raw = decode_payload(header, record[header.header_size :])
        except CorruptRecord as e:
            return self._bad(key, _header_or_none(got), e, count)
        copy_into(out, raw, header.raw_size)
        return self._hit(key, header, count)

    def _read_parts(
        self, op: str, key: ChunkKey, m: Manifest, out: memoryview | None, count: bool
    ) -> Any:
        h = m.header
        buf: bytearray | None = None
        if out is not None and h.codec == Codec.RAW and h.raw_size <= out.nbytes:
            payload = (out if out.format == "B" and out.ndim == 1 else out.cast("B"))[
                : h.stored_size
            ]
        else:
            buf = bytearray(h.header_size + h.stored_size)
            buf[: h.header_size] = m.head
            payload = memoryview(buf)[h.header_size :]
        names = part_names(self._p, key, m.count)
        cmds: list[tuple[tuple[str, str], Sink[Any] | None]] = [
            (("GET", n), part_sink(payload[a:b]))
            for n, (a, b) in zip(names, m.spans(), strict=True)
        ]
        try:
            res = self._call(op, lambda _c: self._values.stream(names[0], cmds, self._timeout_s))
        except TierError:
            return self._miss(count)
        bad = next((r for r in res if isinstance(r, BaseException)), None)
        if bad is not None:
            self._refused(op, bad)
            return self._miss(count)
        if not all(r is True for r in res):
            with self._stats_lock:
                self._torn += 1
            with contextlib.suppress(TierError):
                self._remove([(key, h)])
            return self._miss(count)
        wrong = check(h, m.head, payload, m.mac, self._seal)
        if wrong is not None:
            return self._bad(key, h, wrong, count)
        if buf is None:
            return self._hit(key, h, count)
        if out is None:
            return self._hit(key, h, count, bytes(buf))
        try:
            raw = decode_payload(h, payload)
        except CorruptRecord as e:
            return self._bad(key, h, e, count)
        copy_into(out, raw, h.raw_size)
        return self._hit(key, h, count)

    def _hit(self, key: ChunkKey, header: RecordHeader, count: bool, record: Any = None) -> Any:
        if count:
            self._count(hits=1, bytes_out=header.record_size)
            if self.config.capacity_bytes:
                self._touch(key)
        return header if record is None else record

    def _miss(self, count: bool) -> None:
        if count:
            self._count(misses=1)

    def _bad(
        self, key: ChunkKey, header: RecordHeader | None, error: CorruptRecord, count: bool
    ) -> None:
        self._miss(count)
        with contextlib.suppress(TierError):  # else the next reader deletes it
            self._remove([(key, header)])
        self._refuse(key, error)

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

    def _remove(self, items: Sequence[tuple[ChunkKey, RecordHeader | None]]) -> tuple[int, int]:
        """Delete records (their parts too) and their bookkeeping; (records deleted, bytes
        freed). The record goes first, so a reader never finds it without its parts."""
        if not items:
            return 0, 0

        first: list[tuple[Any, ...]] = []
        for key, _ in items:
            first += [("hget", self._sz, key), ("delete", self._c(key)), ("hdel", self._sz, key)]
        # Its partial-match fields, read now and removed below only where they still name
        # it: where a later chunk sharing the prefix took one over, that one stays filed.
        filings = [
            (self._s(h.parent, h.fingerprint), self._filing(h.token_bytes)) if h else ("", [])
            for _, h in items
        ]
        first += [("hmget", name, fields) for name, fields in filings if fields]
        res = self._pipe("delete", first, retry=False)
        deleted = freed = 0
        for i in range(len(items)):
            size, gone, unbooked = res[3 * i : 3 * i + 3]
            deleted += int(gone)
            if unbooked and size is not None:  # only whoever removed the entry decrements
                freed += int(size)
        named = iter(res[3 * len(items) :])

        keys = [k for k, _ in items]
        second: list[tuple[Any, ...]] = [("zrem", self._lru, *keys), ("srem", self._pin, *keys)]
        for (key, header), (name, fields) in zip(items, filings, strict=True):
            if header is not None:
                second.append(("hdel", self._k(header.parent, header.fingerprint), key))
                if fields:
                    mine = [f for f, v in zip(fields, next(named), strict=True) if v == key]
                    if mine:
                        second.append(("hdel", name, *mine))
                second.append(("srem", self._n(header.fingerprint), key))
                if split(header):  # one DEL each: cluster pipelines refuse multi-key DEL
                    second += [("delete", n) for n in part_names(self._p, key, part_count(header))]
        if freed:
            second.append(("decrby", self._used, freed))
        self._pipe("delete", second, retry=False)
        return deleted, freed

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


def _header_or_none(blob: bytes | bytearray | memoryview) -> RecordHeader | None:
    """The header of a record whose payload may be corrupt (to clean its bookkeeping)."""
    try:
        return parse_header(memoryview(blob))
    except CorruptRecord:
        return None
