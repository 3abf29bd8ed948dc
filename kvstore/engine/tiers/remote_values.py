"""Where the bytes of L3 records travel: kvstore's RESP client, routed to the right server.

The control side of the tier (bookkeeping hashes and sets, scans, pipelines,
cluster topology, sentinel discovery) stays with redis-py / valkey-py. The
record values themselves, the only big things the tier moves, go through
``kvstore.engine.tiers.remote_resp`` (``GET`` into the caller's buffer, ``SET NX`` from
the caller's buffers), to the one server that owns the key:

- standalone: the URL's host, port, credentials and database;
- cluster: the node that owns the key's slot, as the library's cluster client
  knows it (``nodes_manager``). A ``MOVED`` reply (slots moved, a failover)
  makes the library re-read the topology and the call go to the node named in
  the reply; an ``ASK`` reply (a slot being migrated) sends that one call, with
  ``ASKING``, to the node named. At most ``MAX_REDIRECTS`` hops, then the call
  fails. A connection error schedules a topology refresh before the next call
  (a failed-over primary is replaced by its replica);
- sentinel: the primary the sentinels name for the service (``discover_master``),
  asked again after a connection error or a ``READONLY`` reply (the old primary,
  demoted).

TLS URLs (``rediss://``, ``valkeys://``) have no fast path: ``ValuePlane.make``
returns None and the tier moves values through the client library, as before.

Deadlines: every call is one ``timeout_s`` deadline for the whole exchange,
redirects included (``remote_resp``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from kvstore.engine.tiers.remote_parts import WINDOW
from kvstore.engine.tiers.remote_resp import (
    Arg,
    RespConnection,
    RespConnectionError,
    RespError,
    RespPool,
    Sink,
)

T = TypeVar("T")

MAX_REDIRECTS = 5
REFRESH_EVERY_S = 1.0  # at most one topology / primary refresh per this long
SENTINEL_RECHECK_S = 2.0  # with sentinel, ask which server is primary at least this often


class ValuePlane:
    """Bulk value commands (``GET``, ``SET``, ``DEL``) on the server that owns the key."""

    def __init__(
        self,
        connect_timeout_s: float,
        username: str | None,
        password: str | None,
        db: int,
        *,
        address: tuple[str, int] | None = None,
        cluster: Callable[[], Any] | None = None,
        sentinel: Callable[[], tuple[str, int]] | None = None,
    ) -> None:
        self._opts: dict[str, Any] = {
            "connect_timeout_s": connect_timeout_s,
            "username": username,
            "password": password,
            "db": db,
        }
        self._address = address
        self._cluster = cluster  # () -> the library's cluster client (topology owner)
        self._sentinel = sentinel  # () -> the current primary's address
        self._pools: dict[tuple[str, int], RespPool] = {}
        self._lock = threading.Lock()
        self._stale = False  # refresh topology / primary before the next call
        self._refreshed = 0.0
        self.redirects = 0  # MOVED / ASK replies followed
        self.refreshes = 0  # topology or primary re-read after a failed or redirected call
        self.rechecks = 0  # sentinel asked again on schedule

    @classmethod
    def make(
        cls,
        url: str,
        connect_timeout_s: float,
        *,
        cluster: Callable[[], Any] | None = None,
        sentinel: Callable[[], tuple[str, int]] | None = None,
        password: str | None = None,
    ) -> ValuePlane | None:
        """The plane for a client URL, or None where values go through the library (TLS)."""
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("redis", "valkey"):
            return None
        db = 0
        path = parts.path.strip("/")
        if path.isdigit() and cluster is None:
            db = int(path)
        address = None
        if cluster is None and sentinel is None:
            address = (parts.hostname or "127.0.0.1", parts.port or 6379)
        user = unquote(parts.username) if parts.username else None
        secret = unquote(parts.password) if parts.password is not None else password
        return cls(
            connect_timeout_s,
            user,
            secret,
            db,
            address=address,
            cluster=cluster,
            sentinel=sentinel,
        )

    # -- routing ---------------------------------------------------------------------
    def _pool(self, address: tuple[str, int]) -> RespPool:
        with self._lock:
            pool = self._pools.get(address)
            if pool is None:
                pool = self._pools[address] = RespPool(*address, **self._opts)
            return pool

    def _refresh(self) -> None:
        """Re-read the cluster's slots or the sentinels' primary, at most once a second:
        when a call found them stale, and with sentinel every ``SENTINEL_RECHECK_S`` as
        well (a demoted primary keeps accepting writes for a moment before it turns
        read-only, and those writes are lost with it)."""
        now = time.monotonic()
        with self._lock:
            due = self._sentinel is not None and now - self._refreshed >= SENTINEL_RECHECK_S
            if not (self._stale or due) or now - self._refreshed < REFRESH_EVERY_S:
                return
            forced = self._stale or self._address is None
            self._stale, self._refreshed = False, now
            if forced:
                self.refreshes += 1
            else:
                self.rechecks += 1
        if self._cluster is not None:
            self._cluster().nodes_manager.initialize()
        elif self._sentinel is not None:
            try:
                self._address = self._sentinel()
            except Exception:
                if forced:
                    raise
                # A scheduled recheck that cannot reach the sentinels keeps the primary we
                # know: the call itself decides whether it is still there.

    def _owner(self, name: str) -> tuple[str, int]:
        if self._cluster is not None:
            client = self._cluster()
            node = client.nodes_manager.get_node_from_slot(client.keyslot(name))
            return node.host, int(node.port)
        if self._address is None:
            assert self._sentinel is not None
            self._address = self._sentinel()
        return self._address

    def call(
        self, name: str, args: Sequence[Arg], timeout_s: float, sink: Sink[T] | None = None
    ) -> Any:
        """One command on ``name``'s server; its reply (a bulk one through ``sink``)."""
        deadline = time.monotonic() + timeout_s
        self._refresh()
        address = self._owner(name)
        asking = False
        for _ in range(MAX_REDIRECTS + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RespConnectionError(f"{name}: deadline passed while following redirects")
            prefix: tuple[tuple[str, ...], ...] = (("ASKING",),) if asking else ()
            try:
                return self._pool(address).run(functools.partial(_one, args, left, sink, prefix))
            except RespConnectionError:
                self._stale = self._cluster is not None or self._sentinel is not None
                raise
            except RespError as e:
                if e.word == "READONLY" and self._sentinel is not None:
                    self._stale = True  # the primary we know was demoted
                if e.word not in ("MOVED", "ASK") or self._cluster is None:
                    raise
                self.redirects += 1
                host, _, port = str(e).split(" ")[2].rpartition(":")
                address, asking = (host or address[0], int(port)), e.word == "ASK"
                if not asking:
                    with self._lock:
                        self._stale, self._refreshed = True, 0.0
        raise RespConnectionError(f"{name}: more than {MAX_REDIRECTS} cluster redirects")

    def stream(
        self, name: str, cmds: Sequence[tuple[Sequence[Arg], Sink[Any] | None]], timeout_s: float
    ) -> list[object]:
        """Commands on keys of one slot (``name``'s), ``WINDOW`` in flight; replies in order,
        error replies as RespError values. A ``MOVED`` reply sends the whole batch once more
        to the node it names (the commands are idempotent: GET, SET, DEL)."""
        deadline = time.monotonic() + timeout_s
        self._refresh()
        address = self._owner(name)
        for _ in range(2):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                out = self._pool(address).run(functools.partial(_many, cmds, left))
            except RespConnectionError:
                self._stale = self._cluster is not None or self._sentinel is not None
                raise
            moved = next((r for r in out if isinstance(r, RespError) and r.word == "MOVED"), None)
            if moved is None or self._cluster is None:
                return out
            self.redirects += 1
            host, _, port = str(moved).split(" ")[2].rpartition(":")
            address = (host or address[0], int(port))
            with self._lock:
                self._stale, self._refreshed = True, 0.0
        raise RespConnectionError(f"{name}: the batch's slot kept moving")

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


def _one(
    args: Sequence[Arg],
    timeout_s: float,
    sink: Sink[T] | None,
    prefix: Sequence[Sequence[Arg]],
    conn: RespConnection,
) -> object:
    return conn.call(args, timeout_s, sink, prefix=prefix)


def _many(
    cmds: Sequence[tuple[Sequence[Arg], Sink[Any] | None]], timeout_s: float, conn: RespConnection
) -> list[object]:
    return conn.stream(cmds, timeout_s, WINDOW)


class BufferReader:
    """A Reader over bytes already received (what the client library returned)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data)
        self._pos = 0

    def read_into(self, view: memoryview) -> None:
        n = len(view)
        if self._pos + n > len(self._view):
            raise RespConnectionError("value shorter than its length")
        view[:] = self._view[self._pos : self._pos + n]
        self._pos += n


class LibraryPlane:
    """The same calls through the client library, for URLs without a fast path (TLS):
    values arrive as the library's ``bytes`` and are handed to the sinks from there."""

    def __init__(self, client: Callable[[], Any], cluster: bool) -> None:
        self._client = client
        self._cluster = cluster
        self.redirects = self.refreshes = self.rechecks = 0

    def call(
        self, name: str, args: Sequence[Arg], timeout_s: float, sink: Sink[T] | None = None
    ) -> Any:
        return _feed(self._client().execute_command(*_flat(args)), sink)

    def stream(
        self, name: str, cmds: Sequence[tuple[Sequence[Arg], Sink[Any] | None]], timeout_s: float
    ) -> list[object]:
        client = self._client()
        pipe = client.pipeline() if self._cluster else client.pipeline(transaction=False)
        for args, _ in cmds:
            pipe.execute_command(*_flat(args))
        replies = pipe.execute(raise_on_error=False)
        return [
            r if isinstance(r, Exception) else _feed(r, sink)
            for r, (_, sink) in zip(replies, cmds, strict=True)
        ]

    def close(self) -> None:
        pass


def _flat(args: Sequence[Arg]) -> list[Any]:
    return [b"".join(a) if isinstance(a, tuple) else a for a in args]


def _feed(reply: Any, sink: Sink[T] | None) -> Any:
    if reply is True:  # the library's reading of +OK
        return b"OK"
    if sink is None or not isinstance(reply, (bytes, bytearray, memoryview)):
        return reply
    return sink(len(reply), BufferReader(reply))
