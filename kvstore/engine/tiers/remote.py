"""L3: Redis or Valkey, standalone, sentinel or cluster; sharing KV across hosts.

URLs: ``redis://``, ``rediss://`` and ``unix://`` use the ``redis`` client,
``valkey://`` and ``valkeys://`` the ``valkey`` client; ``?cluster=1`` (or
``cluster=true``) selects the cluster client; ``redis+sentinel://h:p[,h:p...]/service``
(``valkey+sentinel://``) asks those sentinels for the service's primary
(kvstore.engine.tiers.remote_client). kvstore's own query parameters are removed before
the URL reaches the client library.

Two clients. Record values, the only big things the tier moves, go over kvstore's
own RESP client (kvstore.engine.tiers.remote_resp, routed by kvstore.engine.tiers.remote_values):
``GET`` received straight into the caller's buffer and verified there, ``SET NX``
sent from the caller's buffers, to the server that owns the key (the cluster
node of its slot, following ``MOVED``/``ASK``; the sentinels' current primary).
Everything else (bookkeeping, pipelines, scans, the cluster's slot map, sentinel
discovery) uses redis-py / valkey-py. TLS URLs move values through the library too.

Keys, all under ``{prefix}:`` (hex in key names so operators can read them;
raw 32-byte keys as set members and hash fields, to keep them small):

    c:<key>           string  the whole record: packed header + payload in config.codec
                              (+ MAC trailer); for a payload over 2 MiB, its manifest
    p:{<key>}:<i>     string  part i of a payload over 2 MiB (kvstore.engine.tiers.remote_parts)
    w:{<prefix>:c:<key>}  string  a writer's claim while it writes a record's parts (expires)
    k:<parent>        hash    child key -> child's token ids (u32le); for partial matching
    k:<ROOT>.<fp>     hash    the same for first chunks: ROOT is shared by every
                              namespace, so its children are kept per namespace
    s:<parent>.<fp>   hash    granularity (u32le) + a child's sub-hash of its first n units
                              -> that child's key, for every n (the latest put wins), per
                              namespace: partial matching reads the fields of one query,
                              not the family (``siblings``)
    n:<fp>            set     chunk keys of one namespace (clear and scan by namespace)
    sz                hash    chunk key -> record bytes; HLEN is the chunk count
    used              string  sum of record bytes (INCRBY / DECRBY)
    lru               zset    chunk key -> last access (wall seconds); only when capacity_bytes > 0
    pin               set     pinned chunk keys

Consistency. A record is one atomic ``SET NX`` of ``c:<key>``; a big one's parts
are written before it, so readers find it whole or not at all: a part missing or
cut short is a miss, the record deleted and counted (``detail.torn``), and the
payload's checksum (and MAC) is checked over all parts together. Part names follow
from the key, so a writer first claims the record (``SET w:... NX PX``, in the
manifest's slot) and checks that no manifest exists, in one round trip: a second
writer of the same chunk, possibly with other bytes (another host's GPU), never
rewrites the parts of a stored record or of one being written; it answers
``EXISTS``. A claim lapses after 3 x ``timeout_ms`` + 1 s if its writer died.
Its bookkeeping follows in a non-transactional pipeline (idempotent: whoever
creates the ``sz`` entry adds to ``used``) and is removed after the record on
delete/clear/evict.
It is best effort: hosts write it concurrently without locks, and a lost reply or
a crash between the steps can leave an entry behind or the counter off;
``recount()`` repairs the counter (eviction runs it when the numbers do not add
up). Readers never trust bookkeeping over the record: ``get`` verifies the
record, ``scan`` skips (and prunes) entries whose record is gone, and
``children`` and ``siblings`` drop (and prune) entries whose record is gone. A put costs
3 round trips (4 with a capacity; a record in parts three more: the claim, its
parts pipelined four at a time, the claim's end); get and contains cost one (a
record in parts two), siblings two (the fields, then the candidates' token ids and
whether their records are still there).

Cluster mode uses no hash tags but the parts' and the claims': every other command
touches exactly one key, pipelines are never transactional, so records spread over all nodes
while each bookkeeping key lives on whichever node owns its slot, and the parts of
one record share a node. With a node down, records on other nodes are still
served; calls that need the missing node fail, count towards the one circuit
breaker of the tier, and degrade as below; the slot map is read again after a
connection error or a ``MOVED`` reply, so a replica promoted in the failed node's
place is found.

Sentinel. The library's sentinel client asks the sentinels for the primary on
each new connection; the value path asks again after a connection error or a
``READONLY`` reply (a demoted primary), at most once a second, so a failover
costs the calls in flight during it (misses, ``UNAVAILABLE`` puts kept for
later) and is then followed.

Capacity. With ``capacity_bytes > 0`` kvstore enforces it: ``put`` reads ``used``
and evicts the least recently used unpinned chunks (``lru``), handing each to
``on_evict`` first. Accesses are buffered locally and flushed to ``lru`` in
batches (before every eviction), so ``get`` stays one round trip. Several
writers may overshoot the limit briefly. With ``capacity_bytes == 0`` there is
no kvstore-side limit: set ``maxmemory`` with ``maxmemory-policy allkeys-lru``
on the server; it then evicts records without telling us, so ``used``/``chunks``
are upper bounds until ``scan`` prunes them, and pinning has no effect there.

Failures. Every call has a deadline (timeout_ms for the whole exchange on the
value path, socket timeouts from timeout_ms and connect_timeout_ms in the
library; the client libraries' own retries are off), goes through
``Retry`` and then the ``CircuitBreaker``. While the breaker is open nothing
touches the network. Degrading methods (the read path and put, so the store keeps
serving from L1/L2): ``get`` -> None (a miss), ``put`` -> UNAVAILABLE (FULL when
the server is out of memory), ``contains`` -> all False, ``children`` and ``siblings`` -> {},
``stats`` -> last known numbers with healthy=False. Raising methods (the caller
asked for a change or a listing it must know happened): ``delete``, ``clear``,
``pin`` and ``scan`` raise TierUnavailable (remote down or breaker open) or
TierError (the server refused), chained to the client's exception.

Refusals (an error reply: WRONGTYPE, NOREPLICAS, READONLY, NOPERM) are not
outages and leave the breaker alone, so reads go on; they are counted, logged
(rate-limited) and make the tier degraded, and puts that keep being refused
open a write breaker of their own (kvstore.engine.tiers.remote_guard).

Authentication. With ``auth_key_file`` every record written carries an HMAC
trailer, and a record read without a valid one is a counted (``corrupt`` and
``forged``), deleted miss. Without it trailers are ignored. Bookkeeping keys
are not authenticated: a planted ``k:``, ``s:`` or ``n:`` entry can make a lookup
promise a chunk whose get then misses, never serve its bytes (a sibling's token ids
are checked against its key, and its shared units counted from them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from kvstore.engine.tiers.remote_base import filing_fields
from kvstore.engine.tiers.remote_client import redact
from kvstore.engine.tiers.remote_guard import Refused
from kvstore.engine.tiers.remote_scan import RemoteListing
from kvstore.engine.tiers.remote_values import ValuePlane
from kvstore.errors import InvalidArgument, TierError
from kvstore.keys import KEY_BYTES, ROOT, ChunkKey, Fingerprint, chunk_key
from kvstore.records import RecordHeader, parse_header, transcode_parts
from kvstore.retry import BreakerState
from kvstore.types import PutStatus, TierStats

SIBLINGS_ASKED = 4  # candidates ``siblings`` checks: the deepest fields' distinct chunks


class RemoteTier(RemoteListing):
    """Redis/Valkey tier. See the module docstring for layout, capacity and failures."""

    # -- writes -------------------------------------------------------------------
    def put(self, header: RecordHeader, payload: bytes | memoryview) -> PutStatus:
        self._check_open()
        if not self._refusals.write_allowed():  # writes keep being refused: skip, unencoded
            self._count(rejected=1)
            return PutStatus.UNAVAILABLE
        head: bytes | memoryview
        if header.codec == self.codec:
            head, body = header.pack(), memoryview(payload)
        else:
            blob = memoryview(transcode_parts(header, payload, self.codec, self.config.level))
            header = parse_header(blob)
            head, body = blob[: header.header_size], blob[header.header_size :]
        if body.ndim != 1 or body.itemsize != 1:
            body = body.cast("B")
        trailer = self._seal.trailer((head, body)) if self._seal is not None else None
        size = len(head) + len(body) + (len(trailer) if trailer else 0)
        key, cap = header.key, self.config.capacity_bytes
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

            def lost() -> None:
                nonlocal lost_reply
                lost_reply = True

            if not self._store(header, head, body, trailer, lost):
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
        filed = self._filing(header.token_bytes)
        if filed:  # the latest chunk of a prefix is the one filed under it
            cmds.append(("hset", self._s(header.parent, header.fingerprint), None, None,
                         dict.fromkeys(filed, key)))  # fmt: skip
        if self.config.capacity_bytes:
            cmds.append(("zadd", self._lru, {key: self._wall()}, True))  # NX: keep a newer access
        if self._pipe("put", cmds)[0]:
            self._pipe("put", [("incrby", self._used, size)], retry=False)

    # -- reads ----------------------------------------------------------------------
    def get(self, key: ChunkKey) -> bytes | None:
        self._check_open()
        record: bytes | None = self._read("get", key, None)
        return record

    def get_into(self, key: ChunkKey, out: memoryview) -> RecordHeader | None:
        """The raw payload into ``out``: a raw record's bytes go from the socket straight
        there (verified in place), others are decoded into it."""
        self._check_open()
        header: RecordHeader | None = self._read("get_into", key, memoryview(out))
        return header

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
        never reported for another namespace. Children whose record is gone (evicted
        by the server's maxmemory policy, say) are dropped too, and their entries
        pruned, so a partial match never promises a chunk that is not there: one more
        round trip when there are children. Degrades to {} when the remote is down.
        """
        self._check_open()
        if parent == ROOT and fingerprint is None:
            raise InvalidArgument("children(ROOT) needs the namespace fingerprint")
        try:
            raw = self._cmd("children", "hgetall", self._k(parent, fingerprint or b""))
        except TierError:
            return {}
        out = {
            ChunkKey(bytes(child)): bytes(tokens)
            for child, tokens in raw.items()
            if _names(parent, fingerprint, child, tokens)
        }
        if not out:
            return out
        try:
            there = self._pipe("children", [("exists", self._c(k)) for k in out])
        except TierError:
            return {}
        gone = [k for k, e in zip(out, there, strict=True) if not e]
        if gone:
            self._unfile_gone("children", parent, fingerprint or b"", gone)
            for k in gone:
                del out[k]
        return out

    def siblings(
        self, parent: ChunkKey, fingerprint: bytes, subhashes: bytes, granularity: int
    ) -> dict[ChunkKey, bytes]:
        """The stored children of ``parent`` in namespace ``fingerprint`` that share the
        most leading units with a chunk whose sub-hashes (at ``granularity``) are
        ``subhashes``, with their token ids: at most ``SIBLINGS_ASKED``, never the whole
        family (``children`` is; ROOT's holds every first chunk of a namespace).

        Each chunk is filed under every unit's sub-hash in ``s:<parent>.<fp>``, the
        latest put of a prefix winning; the deepest fields the query's sub-hashes find
        name the candidates. Two round trips, as ``children``: the fields, then the
        candidates' token ids (``k:``, which checks them against their keys: a planted
        field names nothing) and whether their records are still there (gone ones are
        pruned, with the fields that still name them). One field names one chunk: when
        the chunk named under a prefix goes (deleted, evicted), an older sibling that
        shares that prefix is not found through it until a chunk of that prefix is
        stored again, a partial match missed, never a wrong one. Degrades to {} when
        the remote is down.
        """
        self._check_open()
        fields = filing_fields(subhashes, granularity)
        if not fields:
            return {}
        family = self._s(parent, fingerprint)
        try:
            filed = self._cmd("siblings", "hmget", family, fields)
        except TierError:
            return {}
        picks: list[bytes] = []  # deepest first
        for child in reversed(filed):
            if child is not None and len(child) == KEY_BYTES and bytes(child) not in picks:
                picks.append(bytes(child))
                if len(picks) == SIBLINGS_ASKED:
                    break
        if not picks:
            return {}
        try:
            got = self._pipe(
                "siblings",
                [("hmget", self._k(parent, fingerprint), picks),
                 *[("exists", self._c(k)) for k in picks]],
            )  # fmt: skip
        except TierError:
            return {}
        out: dict[ChunkKey, bytes] = {}
        gone: list[bytes] = []
        for child, tokens, there in zip(picks, got[0], got[1:], strict=True):
            if not there:
                gone.append(child)
            elif _names(parent, fingerprint, child, tokens):
                out[ChunkKey(child)] = bytes(tokens)
        if gone:
            stale = [f for f, c in zip(fields, filed, strict=True) if c is not None and c in gone]
            self._unfile_gone("siblings", parent, fingerprint, gone, stale)
        return out

    def _unfile_gone(
        self,
        op: str,
        parent: ChunkKey,
        fp: bytes,
        gone: Sequence[bytes],
        fields: Sequence[bytes] = (),
    ) -> None:
        """Forget children whose records are gone: their ``k:`` entries and the ``s:``
        fields that still name them. Best effort: the next read prunes what this missed."""
        cmds: list[tuple[Any, ...]] = [("hdel", self._k(parent, fp), *gone)]
        if fields:
            cmds.append(("hdel", self._s(parent, fp), *fields))
        with contextlib.suppress(TierError):
            self._pipe(op, cmds)

    def has_children(self, parent: ChunkKey, fingerprint: bytes) -> bool:
        """Whether ``parent`` has stored children in namespace ``fingerprint`` (one
        EXISTS; an entry whose record is gone still counts). False when down."""
        self._check_open()
        try:
            return bool(self._cmd("children", "exists", self._k(parent, fingerprint)))
        except TierError:
            return False

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
                "torn": self._torn,  # records in parts with a part missing: deleted misses
                "sentinel": self.sentinel is not None,
                "redirects": self._values.redirects,  # cluster MOVED/ASK replies followed
                "refreshes": self._values.refreshes,  # topology / primary re-read
                "rechecks": self._values.rechecks,  # sentinel asked again on schedule
                "fast_path": isinstance(self._values, ValuePlane),
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
            self._values.close()


def _names(parent: ChunkKey, fingerprint: bytes | None, child: bytes, tokens: bytes | None) -> bool:
    """Whether a ``k:`` entry is a chunk of ``parent``: a key's length, whole u32 token
    ids, and (with the namespace known) the key hashing from them, so an entry planted or
    left by another namespace names nothing."""
    if len(child) != KEY_BYTES or not tokens or len(tokens) % 4:
        return False
    if fingerprint is None:
        return True
    return chunk_key(parent, Fingerprint(fingerprint), bytes(tokens)) == child
