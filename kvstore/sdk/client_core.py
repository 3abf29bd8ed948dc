"""The client core: each operation of the SDK written once, for both clients.

An operation is a *plan*: a generator that yields the steps it needs and is sent
their results, then returns the operation's result. A step is one of

    Call(method, request, timeout)        -> the reply message of a unary (or Put) RPC
    GetStream(request, timeout, sink)     -> None; each message of the Get stream went to sink
    NEED_ARENA                            -> the mapped arena, or None: the data plane to use
    ReleaseLater(lease_ids, drop_keys)    -> None; a Release sent without waiting for it
    Tell(method, message)                 -> None; any call sent so, its failure unheard of
    HealthCheck(request, timeout)         -> the health reply, None if the check failed
    Send(pipe, call)                      -> None; the call is on its way, not waited for
    Receive(pipe)                         -> the reply of the pipe's oldest call not received

``kvstore.sdk.client.Client`` drives a plan with blocking calls (``run_blocking``),
``kvstore.sdk.aio.AsyncClient`` with awaits, as redis-py writes its commands once for
both of its clients. What a plan decides is then the same in both: the request,
how the reply is read, shared memory or stream, the fallbacks (a lease that may
have expired, a corrupt read, a chunk L1 cannot take) and the retries (a tenant's
namespace not proved yet). A step that fails is thrown into the plan as the
kvstore error of its status (``kvstore.sdk.wire.error_from_rpc``): plans see only
kvstore errors. The writes (put, put_chunk, reserve, commit) are in
``kvstore.sdk.client_writes``, the lookups (and the leases a lookup lends) in
``kvstore.sdk.client_lookup``.

A transport provides, besides the steps: ``_session_alive()`` and starting the
Session stream once ``setup_plane`` has mapped an arena (a thread, or a task).
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, NamedTuple, TypeVar

from kvstore.arena import ArenaView, as_u8
from kvstore.errors import InvalidArgument, KVStoreError, NotFound, ServerError
from kvstore.protocol import (
    MAX_RESERVE_BATCH,
    SERVICE_NAME,
    chunk_from_pb,
    stats_from_pb,
)
from kvstore.records import RecordHeader, parse_header
from kvstore.sdk.base import LEASE_MARGIN, ClientBase
from kvstore.sdk.chunks import GetAssembler, NamespaceLike
from kvstore.sdk.shm import USE_GET, LeaseBase, UseGet
from kvstore.sdk.wire import NamespaceInfo, ServerInfo, info_from_pb
from kvstore.types import ChunkView, StoreStats
from kvstore.v1 import kvstore_pb2 as pb

T = TypeVar("T")
L = TypeVar("L", bound=LeaseBase)

# The unary methods plans call by name (each transport maps them onto its stub), and Put.
UNARY_METHODS: Final = (
    "Info",
    "Stats",
    "Lookup",
    "Exists",
    "Delete",
    "Clear",
    "Pin",
    "List",
    "Namespaces",
    "Acquire",
    "AcquireMany",
    "Release",
    "ReserveMany",
    "Commit",
    "CommitMany",
    "Abort",
)
PUT: Final = "Put"  # stream-unary: the request is an iterator of raw frames


@dataclass(frozen=True, slots=True)
class Call:
    """One RPC: ``method`` (in ``UNARY_METHODS``, or ``PUT``) also names it in errors."""

    method: str
    request: Any
    timeout: float | None  # None: the client's default


@dataclass(frozen=True, slots=True)
class GetStream:
    request: pb.GetRequest
    timeout: float | None
    sink: GetAssembler


@dataclass(frozen=True, slots=True)
class ReleaseLater:
    """Release leases that surely still hold (or whose bytes were verified), not waiting
    for the answer: a get costs one round trip, not two. Kept track of so ``close`` lets
    it land."""

    lease_ids: tuple[int, ...]
    drop_keys: tuple[bytes, ...] = ()  # chunks to drop once released (``drop``)
    holder: str = ""  # the session holding the leases, when not this client's (lent)
    method: ClassVar[str] = "Release"

    def request(self) -> pb.ReleaseRequest:
        return pb.ReleaseRequest(
            lease_ids=self.lease_ids, drop_keys=self.drop_keys, holder=self.holder
        )


@dataclass(frozen=True, slots=True)
class Tell:
    """A unary call sent as ``ReleaseLater`` is: not waited for, its failure unheard of.
    What a server is told in passing (the lookups a client answered by the presence
    filter, ``kvstore.sdk.presence``)."""

    method: str
    message: Any

    def request(self) -> Any:
        return self.message


class Dropped(NamedTuple):
    """What one Release with drops did."""

    released: int  # leases the server still held
    dropped: int  # chunks deleted from every tier now
    deferred: int  # chunks other leases hold: deleted from every tier when the last ends


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """The standard gRPC health check: no metadata, and a failure is an answer."""

    request: Any
    timeout: float | None


class Pipe:
    """Calls in flight together, their replies received in the order they were sent
    (``Send``, ``Receive``): a plan overlaps its own work with the server's, as
    ``put_many`` writes one part of a batch while the next part is reserved. The
    transport keeps its state here (``state``, with an ``end()``: a connection of the
    express plane, or the calls' tasks). A plan that sends ends the pipe with ``end``,
    in a ``finally``: not a step, so a plan dropped half-way (closed, collected) ends it
    too. The server may run a pipe's calls in any order (over gRPC it may): a plan sends
    a call only once what it depends on was received."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: Any = None

    def end(self) -> None:
        """Let the transport's state go: the connection back to its pool once every
        reply was received (else closed), calls not received cancelled. Never raises."""
        state, self.state = self.state, None
        if state is not None:
            with contextlib.suppress(Exception):
                state.end()


@dataclass(frozen=True, slots=True)
class Send:
    pipe: Pipe
    call: Call


@dataclass(frozen=True, slots=True)
class Receive:
    """The reply of the pipe's oldest call not yet received; its error raised."""

    pipe: Pipe


class _NeedArena:
    def __repr__(self) -> str:
        return "NEED_ARENA"


NEED_ARENA: Final = _NeedArena()
Step = Call | GetStream | ReleaseLater | Tell | HealthCheck | _NeedArena | Send | Receive
Plan = Generator[Step, Any, T]
STREAM: Final = USE_GET  # what read_lease says when the bytes must come by Get


def run_blocking(plan: Plan[T], do: Callable[[Step], Any]) -> T:
    """Drive ``plan`` to its end: each step done by ``do``, what it raises thrown in."""
    try:
        step = next(plan)
        while True:
            try:
                result = do(step)
            except BaseException as e:
                step = plan.throw(e)
            else:
                step = plan.send(result)
    except StopIteration as stop:
        return stop.value


def rpc(method: str, request: Any, timeout: float | None) -> Plan[Any]:
    """One call, its reply as is."""
    return (yield Call(method, request, timeout))


# -- server ----------------------------------------------------------------------------


def info(c: ClientBase, timeout: float | None) -> Plan[ServerInfo]:
    c._info = info_from_pb((yield Call("Info", pb.InfoRequest(), timeout)))
    return c._info


def health(timeout: float | None) -> Plan[bool]:
    from grpc_health.v1 import health_pb2

    req = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    resp = yield HealthCheck(req, timeout)
    return resp is not None and resp.status == health_pb2.HealthCheckResponse.SERVING


def stats(timeout: float | None) -> Plan[StoreStats]:
    return stats_from_pb((yield Call("Stats", pb.StatsRequest(), timeout)))


def setup_plane(c: ClientBase) -> Plan[ArenaView | None]:
    """Look at the server's Info and map its arena if this client may (on first use),
    again when the Session stream ended: a restarted server has a new arena; the same
    one (a broken stream) keeps its mapping and needs a new Session, which the
    transport starts when ``_session`` is None (unless the server refused one)."""
    if c._closed:
        raise KVStoreError("the client is closed")
    if c._shm_checked and c._session is not None and not c._session_alive():
        now = yield from info(c, None)
        if c._arena is not None and c._same_arena(now):
            c._session = None
            return c._arena
        # The new arena is mapped before the old one is unmapped (on a thread of its
        # own): an unmap holds the process's mapping lock while it frees the old pages.
        old, c._arena, c._session, c._shm_checked = c._arena, None, None, False
        try:
            c._arena = c._open_arena(now)
            c._open_disk(now)
            c._shm_checked = True
        finally:
            if old is not None:
                c._retire_arena(old)
        return c._arena
    if not c._shm_checked:
        now = yield from info(c, None)
        c._arena = c._open_arena(now)
        c._open_disk(now)
        c._shm_checked = True
    return c._arena


# -- reads -----------------------------------------------------------------------------


def acquire(
    c: ClientBase, key: bytes, timeout: float | None, make: Callable[..., L]
) -> Plan[L | None]:
    """A lease the caller reads in place (the server checked the pages before granting
    it), built by ``make(header, lease_id, extents, payload_offset, arena)``."""
    arena = yield NEED_ARENA
    if arena is None:
        raise KVStoreError("acquire needs the shared-memory data plane (same host)")
    t0 = c._clock()
    a = yield Call("Acquire", pb.AcquireRequest(key=key), timeout)
    if not a.found:
        return None
    try:
        header = parse_header(a.header, expect_key=key)
        extents = c._check_extents(a.extents)
    except KVStoreError:
        yield from release(a.lease_id, timeout)
        raise
    until = t0 + a.expires_ms / 1000 * LEASE_MARGIN
    return make(header, a.lease_id, extents, a.payload_offset, arena, valid_until=until)


def acquire_many(
    c: ClientBase,
    keys: Sequence[bytes],
    verify: bool | None,
    timeout: float | None,
    make: Callable[..., L],
    disk: bool = False,
) -> Plan[builtins.list[L | UseGet | None]]:
    """Leases on many chunks, one AcquireMany per ``MAX_RESERVE_BATCH`` keys: for each
    key a lease, ``USE_GET`` (stored, but L1 cannot lend it now: get/get_into streams it)
    or None (a miss). ``verify`` (default: the client's): the caller checks the payload
    as it copies it (``read_verified``/``read_scattered``), so the server checks only
    the headers; False: the server checks every payload before lending it. ``disk``
    (with ``verify``): a chunk only in L2 may be lent where it lies in L2's file, a
    lease over the client's read-only mapping of it, instead of promoted into L1."""
    arena = yield NEED_ARENA
    if arena is None:
        raise KVStoreError("acquire_many needs the shared-memory data plane (same host)")
    client_verifies = c.verify if verify is None else verify
    out: builtins.list[L | UseGet | None] = []
    granted: builtins.list[int] = []  # every lease the server handed out, until returned
    try:
        for i in range(0, len(keys), MAX_RESERVE_BATCH):
            batch = [bytes(k) for k in keys[i : i + MAX_RESERVE_BATCH]]
            t0 = c._clock()
            req = pb.AcquireManyRequest(
                keys=batch,
                client_verifies=client_verifies,
                client_reads_disk=disk and client_verifies and c._disk_view() is not None,
            )
            r = yield Call("AcquireMany", req, timeout)
            granted += [a.lease_id for a in r.responses if a.found]
            if len(r.responses) != len(batch):
                raise ServerError(f"AcquireMany answered {len(r.responses)} of {len(batch)}")
            for key, a in zip(batch, r.responses, strict=True):
                if not a.found:
                    out.append(USE_GET if a.use_get else None)
                    continue
                header = parse_header(a.header, expect_key=key)
                extents = c._check_extents(a.extents, disk=a.on_disk)
                until = t0 + a.expires_ms / 1000 * LEASE_MARGIN
                view = c._disk if a.on_disk else arena
                out.append(
                    make(header, a.lease_id, extents, a.payload_offset, view, valid_until=until)
                )
    except BaseException:
        if granted:  # a bad answer or a later batch failed: no lease outlives the call
            yield ReleaseLater(tuple(granted))
        raise
    return out


def release_many(leases: Sequence[LeaseBase], timeout: float | None) -> Plan[int]:
    """End many leases in one Release; how many the server still held (fewer: some had
    expired or were dropped, so what was read through them may be wrong unless verified).
    Leases already released are skipped."""
    released = 0
    for holder, ids in _ending(leases).items():  # one Release (a second for lent leases)
        released += yield from _release_held(ids, holder, timeout)
    return released


def release_later(leases: Sequence[LeaseBase], drop: Sequence[bytes] = ()) -> Plan[None]:
    """End many leases with one Release not waited for (off the caller's critical path;
    a second for leases lent to another session), dropping the chunks ``drop`` names in
    the first (see ``drop``)."""
    keys = _drop_keys(drop)
    ending = _ending(leases) or ({"": []} if keys else {})
    for holder, ids in ending.items():
        yield ReleaseLater(tuple(ids), keys, holder)
        keys = ()


def drop(
    keys: Sequence[bytes], leases: Sequence[LeaseBase], timeout: float | None
) -> Plan[Dropped]:
    """End ``leases`` and drop the chunks ``keys`` names, in one Release: each chunk is
    deleted from every tier now, or, while another lease holds it, once the last one
    ends (it stays readable for that holder). Keys not stored, or of chunks the caller
    may not see (another tenant's), are skipped."""
    ending, drop_keys = _ending(leases), _drop_keys(keys)
    if not ending and not drop_keys:
        return Dropped(0, 0, 0)
    lent = {h: ids for h, ids in ending.items() if h}
    released = 0
    for holder, ids in lent.items():  # leases lent to another session: ended first
        released += yield from _release_held(ids, holder, timeout)
    req = pb.ReleaseRequest(lease_ids=ending.get("", []), drop_keys=drop_keys)
    r = yield Call("Release", req, timeout)
    return Dropped(released + int(r.released), int(r.dropped), int(r.drop_deferred))


def _release_held(ids: builtins.list[int], holder: str, timeout: float | None) -> Plan[int]:
    try:
        r = yield Call("Release", pb.ReleaseRequest(lease_ids=ids, holder=holder), timeout)
    except NotFound:
        return 0
    return int(r.released)


def _drop_keys(keys: Sequence[bytes]) -> tuple[bytes, ...]:
    out = tuple(dict.fromkeys(bytes(k) for k in keys))
    if len(out) > MAX_RESERVE_BATCH:  # one Release: the server's bound, said here first
        raise InvalidArgument(f"{len(out)} chunks to drop in one call; at most {MAX_RESERVE_BATCH}")
    return out


def _ending(leases: Sequence[LeaseBase]) -> dict[str, builtins.list[int]]:
    """The ids of the leases not released yet by the session holding them ("": this
    client's), each marked released (once)."""
    pairs = [(lease.holder, lease.id) for lease in leases if not lease.released]
    for lease in leases:
        lease.released = True
    return by_holder(pairs)


def by_holder(pairs: Iterable[tuple[str, int]]) -> dict[str, builtins.list[int]]:
    """Lease ids grouped by the session that holds them, each once, in order: a Release
    names one holder, so ending leases of several sessions takes one Release each."""
    ids: dict[str, dict[int, None]] = {}
    for holder, lid in pairs:
        ids.setdefault(holder, {})[lid] = None
    return {h: builtins.list(held) for h, held in ids.items()}


def release(lease_id: int, timeout: float | None, holder: str = "") -> Plan[bool]:
    """False if the lease was gone (expired, or dropped with a broken Session).
    ``holder``: the session holding it, when not this client's (a lent lease)."""
    return (yield from _release_held([lease_id], holder, timeout)) == 1


def read_lease(c: ClientBase, key: bytes, timeout: float | None) -> Plan[LeaseBase | UseGet | None]:
    """A lease for get/get_into to copy out of, ``STREAM`` when the bytes must come by
    Get (no shared memory here, or the server says so), None on a miss."""
    arena = yield NEED_ARENA
    if arena is None:
        return STREAM
    t0 = c._clock()
    a = yield Call("Acquire", pb.AcquireRequest(key=key, client_verifies=c.verify), timeout)
    if not a.found:
        return STREAM if a.use_get else None
    try:
        header = parse_header(a.header, expect_key=key)
        extents = c._check_extents(a.extents)
    except KVStoreError:
        yield from release(a.lease_id, timeout)
        raise
    until = t0 + a.expires_ms / 1000 * LEASE_MARGIN
    return LeaseBase(header, a.lease_id, extents, a.payload_offset, arena, until)


def done_with(c: ClientBase, lease: LeaseBase, timeout: float | None) -> Plan[bool]:
    """Release a lease read by get/get_into; False if what was read may be wrong.

    While the lease surely still holds, the Release is sent without waiting for its
    answer; past that, the answer says whether the pages were still ours."""
    lease.released = True
    if c._clock() >= lease.valid_until:
        return (yield from release(lease.id, timeout))
    yield ReleaseLater((lease.id,))
    return True


def get_stream(
    key: bytes, out: Any | None, timeout: float | None
) -> Plan[tuple[RecordHeader, bytes] | None]:
    sink = GetAssembler(key, out)
    yield GetStream(pb.GetRequest(key=key), timeout, sink)
    return sink.finish()


def get(
    c: ClientBase, key: bytes, timeout: float | None
) -> Plan[tuple[RecordHeader, bytes] | None]:
    got = yield from read_lease(c, key, timeout)
    if isinstance(got, LeaseBase):
        try:
            data = got.read()
        finally:
            ok = yield from done_with(c, got, timeout)
        if ok and c._verified(got.header, data):
            return got.header, data
        got = STREAM  # expired while we read, or corrupt: the server decides
    if got is None:
        return None
    return (yield from get_stream(key, None, timeout))


def get_into(
    c: ClientBase, key: bytes, out: Any, timeout: float | None
) -> Plan[RecordHeader | None]:
    dst = as_u8(out, writable=True)
    got = yield from read_lease(c, key, timeout)
    if isinstance(got, LeaseBase):
        digest = None
        try:
            if c.verify:
                digest = got.read_into_hashed(dst)  # hashed as it is copied
            else:
                got.read_into(dst)
        finally:
            ok = yield from done_with(c, got, timeout)
        if ok and (not c.verify or digest == got.header.payload_checksum):
            return got.header
        got = STREAM  # expired while we read, or corrupt: the server decides
    if got is None:
        return None
    found = yield from get_stream(key, dst, timeout)
    return found[0] if found else None


# -- lookup and management -------------------------------------------------------------


def exists(keys: Sequence[bytes], timeout: float | None) -> Plan[builtins.list[tuple[int, ...]]]:
    r = yield Call("Exists", pb.ExistsRequest(keys=list(keys)), timeout)
    return [tuple(t.tiers) for t in r.found]


def delete(keys: Sequence[bytes], timeout: float | None) -> Plan[int]:
    r = yield Call("Delete", pb.DeleteRequest(keys=list(keys)), timeout)
    return int(r.deleted)


def clear(
    c: ClientBase, namespace: NamespaceLike | None, all: bool, timeout: float | None
) -> Plan[int]:
    r = yield Call("Clear", c._clear_request(namespace, all), timeout)
    return int(r.removed)


def pin(keys: Sequence[bytes], pinned: bool, timeout: float | None) -> Plan[int]:
    r = yield Call("Pin", pb.PinRequest(keys=list(keys), pinned=pinned), timeout)
    return int(r.changed)


def list_page(
    c: ClientBase,
    namespace: NamespaceLike | None,
    tier: int,
    pinned_only: bool,
    page_size: int,
    token: str,
    timeout: float | None,
) -> Plan[tuple[builtins.list[ChunkView], str]]:
    """One page of ``list``: its chunks and the next page's token ("" after the last)."""
    req = c._list_request(namespace, tier, pinned_only, page_size, token)
    r = yield Call("List", req, timeout)
    return [chunk_from_pb(m) for m in r.chunks], r.next_page_token


def namespaces(c: ClientBase, timeout: float | None) -> Plan[builtins.list[NamespaceInfo]]:
    return c._namespaces((yield Call("Namespaces", pb.NamespacesRequest(), timeout)))
