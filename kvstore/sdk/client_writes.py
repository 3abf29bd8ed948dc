"""The writes of the client core (``kvstore.sdk.client_core``): put, put_chunk, put_many,
and writing in place in the server's arena (same host only): ``reserve`` a batch in
one round trip, write each payload into its pages, commit them one by one
(``finish``) or together (``commit``).

A put goes through shared memory where the client has the server's arena mapped
(ReserveMany, one copy into the pages, Commit) and is streamed (Put) otherwise,
or when L1 cannot take the chunk now (FULL, TOO_LARGE: the server's Put writes
it to a lower tier). ``put_chunk`` does not hash the payload up front when it
goes through shared memory (it is hashed as it is copied, and the checksum goes with
the Commit), and hashes it first only when it must stream.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import xxhash

from kvstore.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KVStoreError,
    NamespaceNotRegistered,
    ServerError,
    ServerUnavailable,
)
from kvstore.keys import ChunkKey, Namespace
from kvstore.protocol import MAX_RESERVE_BATCH, status_from_pb
from kvstore.records import RecordHeader
from kvstore.sdk.base import LEASE_MARGIN, ClientBase
from kvstore.sdk.chunks import NamespaceLike, Tokens, chunk_header
from kvstore.sdk.client_core import (
    NEED_ARENA,
    PUT,
    Call,
    Pipe,
    Plan,
    Receive,
    Send,
    info,
)
from kvstore.sdk.client_lookup import lookup
from kvstore.sdk.shm import ReservationBase
from kvstore.sdk.wire import error_from_code
from kvstore.types import PutStatus
from kvstore.v1 import kvstore_pb2 as pb

R = TypeVar("R", bound=ReservationBase)

# A put_many's chunks go through the arena in up to this many parts, pipelined: while
# the client writes one part's payloads into their pages, the server reserves the next
# part and commits the one before. With the writes on one core and the server's
# bookkeeping (some 40 µs a chunk for a reservation and its commit) on the other, a
# batch costs about its copies plus one part's reservation and one part's commit,
# instead of the copies plus all of both; calls stay 2 x PIPE_PARTS a batch of up to
# 4 x MAX_RESERVE_BATCH chunks (more take more parts of that size). Only where the
# transport overlaps them (``ClientBase._pipelines``): else in one part.
PIPE_PARTS = 4


def put(
    c: ClientBase, header: RecordHeader, payload: Any, timeout: float | None
) -> Plan[PutStatus]:
    if c._info is None:
        yield from info(c, timeout)
    return (yield from _put(c, header, payload, timeout, sealed=True))


def put_chunk(
    c: ClientBase,
    namespace: NamespaceLike,
    parent: ChunkKey,
    tokens: Tokens,
    payload: Any,
    dtype: str,
    shape: Sequence[int],
    timeout: float | None,
) -> Plan[tuple[ChunkKey, PutStatus]]:
    """On a server with tenants, a namespace the server does not know as the caller's yet
    is proved with a Lookup that carries it (docs/security.md), and the put retried."""
    if c._info is None:
        yield from info(c, timeout)
    # Through shared memory the payload is hashed as it is copied in: not hashed here.
    sealed = (yield NEED_ARENA) is None
    header = chunk_header(namespace, parent, tokens, payload if sealed else None, dtype, shape)
    try:
        return header.key, (yield from _put(c, header, payload, timeout, sealed=sealed))
    except NamespaceNotRegistered:
        if not isinstance(namespace, Namespace):  # a fingerprint alone proves nothing
            raise
    yield from lookup(c, namespace, [], timeout=timeout)
    return header.key, (yield from _put(c, header, payload, timeout, sealed=sealed))


def _put(
    c: ClientBase, header: RecordHeader, payload: Any, timeout: float | None, *, sealed: bool
) -> Plan[PutStatus]:
    """``sealed=False``: the header's checksum is a placeholder; the payload is hashed
    as it is copied into the arena and the checksum goes with the Commit, and a put
    that must stream hashes the payload here first."""
    src = c._check_put(header, payload)
    if (yield NEED_ARENA) is not None:
        status = yield from _put_shm(c, header, src, timeout, sealed)
        if status is not None:
            return status
    return (yield from _stream(c, header, src, timeout, sealed))


def _stream(
    c: ClientBase, header: RecordHeader, src: np.ndarray, timeout: float | None, sealed: bool
) -> Plan[PutStatus]:
    """A put streamed (Put); an unsealed header gets the payload's checksum first."""
    if not sealed:
        header = header.with_checksum(xxhash.xxh3_64_intdigest(src.data))
    r = yield Call(PUT, c._put_frames(header, src), timeout)
    return status_from_pb(r.status)


def put_many(
    c: ClientBase,
    headers: Sequence[RecordHeader],
    payloads: Sequence[Any],
    checksum_at_commit: bool,
    timeout: float | None,
) -> Plan[builtins.list[PutStatus]]:
    """Each chunk's status, as ``put`` would give it (see ``Client.put_many``)."""
    if len(payloads) != len(headers):
        raise InvalidArgument(f"{len(payloads)} payloads for {len(headers)} headers")
    if c._info is None:
        yield from info(c, timeout)
    srcs = [c._check_put(h, p) for h, p in zip(headers, payloads, strict=True)]
    out: builtins.list[PutStatus | None] = [None] * len(headers)
    arena = yield NEED_ARENA
    failed = None
    if arena is not None and headers:
        failed = yield from _put_many_shm(c, arena, headers, srcs, checksum_at_commit, timeout, out)
    for i, status in enumerate(out):
        if status is _REFUSED or (status is None and arena is None):
            # L1 cannot take it now, or no arena here: Put sends it below.
            out[i] = yield from _stream(c, headers[i], srcs[i], timeout, not checksum_at_commit)
    if failed is not None:
        raise failed
    return cast(builtins.list[PutStatus], out)


_REFUSED: Any = object()  # put_many: a chunk L1 refused (FULL, TOO_LARGE), for Put


def _put_many_shm(
    c: ClientBase,
    arena: Any,
    headers: Sequence[RecordHeader],
    srcs: Sequence[np.ndarray],
    at_commit: bool,
    timeout: float | None,
    out: builtins.list[Any],
) -> Plan[KVStoreError | None]:
    """``out[i]`` for each chunk the arena took (STORED, or EXISTS), ``_REFUSED`` where L1
    refused it (FULL, TOO_LARGE); the first error a commit met, returned once every answer
    is in (the other chunks are stored). The parts' ReserveMany calls go out together;
    each part's payloads are written once its reservations are in and its CommitMany sent
    behind them (PIPE_PARTS). Any other failure is raised once the commits already sent
    are answered, every reservation whose commit was not sent aborted, those of parts not
    reached included (an Abort of one
    that was committed after all is refused, harmlessly; after a broken link the server
    lets what is left expire)."""
    n = len(headers)
    per = min(MAX_RESERVE_BATCH, -(-n // (PIPE_PARTS if c._pipelines() else 1)))
    parts = [range(i, min(n, i + per)) for i in range(0, n, per)]
    base = timeout if timeout is not None else c.timeout
    pipe = Pipe()
    open_ids: dict[int, None] = {}  # reservations made whose commit was not answered
    sent: builtins.list[builtins.list[tuple[int, ReservationBase]]] = []
    unanswered = 0  # ReserveMany calls sent whose answers were not taken
    taken = 0  # CommitMany calls sent whose answers were taken
    try:
        t0 = c._clock()
        for part in parts:
            reqs = [
                pb.ReserveRequest(header=headers[i].pack(), checksum_at_commit=at_commit)
                for i in part
            ]
            yield Send(pipe, Call("ReserveMany", pb.ReserveManyRequest(requests=reqs), timeout))
            unanswered += 1
        for part in parts:
            unanswered -= 1  # taken off the pipe by the Receive, answered or failed
            r = yield Receive(pipe)
            open_ids.update((one.reservation_id, None) for one in r.responses if one.reservation_id)
            if len(r.responses) != len(part):
                raise ServerError(f"ReserveMany answered {len(r.responses)} of {len(part)}")
            mine: builtins.list[tuple[int, ReservationBase]] = []
            for i, one in zip(part, r.responses, strict=True):
                status = status_from_pb(one.status)
                if status != PutStatus.STORED:
                    out[i] = status if status == PutStatus.EXISTS else _REFUSED
                    continue
                until = t0 + one.expires_ms / 1000 * LEASE_MARGIN
                extents = c._check_extents(one.extents)
                res = ReservationBase(
                    headers[i], one.reservation_id, extents, one.payload_offset, arena, None,
                    until, at_commit, c._clock,
                )  # fmt: skip
                mine.append((i, res))
            for i, res in mine:
                res.write(srcs[i])  # hashed as it is copied (checksum_at_commit)
            if mine:
                commits = [
                    pb.CommitRequest(reservation_id=res.id, payload_checksum=res.closing())
                    for _, res in mine
                ]
                # As ``commit``: a server with verify_reads off hashes each payload.
                wait = base + sum(res.nbytes for _, res in mine) / 1e9
                yield Send(pipe, Call("CommitMany", pb.CommitManyRequest(commits=commits), wait))
                sent.append(mine)
        failed: KVStoreError | None = None
        for mine in sent:
            taken += 1
            r = yield Receive(pipe)
            if len(r.responses) != len(mine):
                raise ServerError(f"CommitMany answered {len(r.responses)} of {len(mine)}")
            for _, res in mine:
                open_ids.pop(res.id, None)
            for (i, _), one in zip(mine, r.responses, strict=True):
                if one.error_code:
                    failed = failed or error_from_code(one.error_code, one.error, "Commit", c.url)
                else:
                    out[i] = status_from_pb(one.status)
        return failed
    except BaseException as e:
        if isinstance(e, GeneratorExit):  # the plan was dropped: no step may be asked for
            raise
        for _ in range(unanswered):  # the parts not reached: their pages go back too
            try:
                r = yield Receive(pipe)
            except KVStoreError:
                continue  # refused too, or the link failed (then each fails at once)
            open_ids.update((one.reservation_id, None) for one in r.responses if one.reservation_id)
        # The commits already sent are answered first: aborted on another connection
        # meanwhile, a part's chunks raced their own commit (some stored, some not).
        for mine in sent[taken:]:
            try:
                r = yield Receive(pipe)
            except KVStoreError:
                continue
            for _, res in mine:
                open_ids.pop(res.id, None)
        for rid in open_ids:
            try:
                yield Call("Abort", pb.AbortRequest(reservation_id=rid), timeout)
            except (ServerUnavailable, DeadlineExceeded):
                break  # the server is gone or stalled: the rest expire (lease_ms)
            except KVStoreError:
                pass  # committed after all, or expired: nothing held
        raise
    finally:
        pipe.end()


def _put_shm(
    c: ClientBase, header: RecordHeader, src: np.ndarray, timeout: float | None, sealed: bool
) -> Plan[PutStatus | None]:
    """The status of a put through the arena; None when it must stream instead."""

    def make(*lent: Any) -> ReservationBase:  # ended by this plan itself: no finish
        h, rid, extents, offset, arena, until, at_commit = lent
        return ReservationBase(h, rid, extents, offset, arena, None, until, at_commit, c._clock)

    (res,) = yield from reserve(c, [header], not sealed, timeout, make)
    if isinstance(res, PutStatus):
        # FULL/TOO_LARGE for L1: Put writes it straight to a lower tier.
        return res if res == PutStatus.EXISTS else None
    try:
        res.write(src)  # unsealed: hashed as it is copied (accel.scatter_xxh3)
    except BaseException:
        yield from abort(res, timeout)
        raise
    return (yield from finish(res.id, True, res.closing(), timeout))


def reserve(
    c: ClientBase,
    headers: Sequence[RecordHeader],
    checksum_at_commit: bool,
    timeout: float | None,
    make: Callable[..., R],
) -> Plan[builtins.list[R | PutStatus]]:
    """For each header, a reservation built by ``make(header, reservation_id, extents,
    payload_offset, arena, valid_until, checksum_at_commit)``, or the status a put would
    get without one (see ``Client.reserve``)."""
    arena = yield NEED_ARENA
    if arena is None:
        raise KVStoreError("reserve needs the shared-memory data plane (same host)")
    out: builtins.list[R | PutStatus] = []
    try:
        for i in range(0, len(headers), MAX_RESERVE_BATCH):
            batch = headers[i : i + MAX_RESERVE_BATCH]
            t0 = c._clock()
            r = yield Call(
                "ReserveMany",
                pb.ReserveManyRequest(
                    requests=[
                        pb.ReserveRequest(header=h.pack(), checksum_at_commit=checksum_at_commit)
                        for h in batch
                    ]
                ),
                timeout,
            )
            if len(r.responses) != len(batch):
                raise ServerError(f"ReserveMany answered {len(r.responses)} of {len(batch)}")
            for h, one in zip(batch, r.responses, strict=True):
                status = status_from_pb(one.status)
                if status != PutStatus.STORED:
                    out.append(status)
                    continue
                until = t0 + one.expires_ms / 1000 * LEASE_MARGIN
                extents = c._check_extents(one.extents)
                out.append(
                    make(
                        h,
                        one.reservation_id,
                        extents,
                        one.payload_offset,
                        arena,
                        until,
                        checksum_at_commit,
                    )
                )
    except BaseException:
        for res in out:  # a later batch failed: give back what earlier ones got
            if isinstance(res, ReservationBase):
                yield from abort(res, timeout)
        raise
    return out


def commit(
    c: ClientBase,
    reservations: Sequence[ReservationBase],
    checksums: Sequence[int | None] | None,
    timeout: float | None,
) -> Plan[builtins.list[PutStatus | KVStoreError]]:
    """Several reservations of this client in one CommitMany per batch (see ``Client.commit``)."""
    sums = list(checksums) if checksums is not None else [None] * len(reservations)
    if len(sums) != len(reservations):
        raise InvalidArgument(f"{len(sums)} checksums for {len(reservations)} reservations")
    if len({id(res) for res in reservations}) != len(reservations):
        raise InvalidArgument("the same reservation twice in one commit")
    for res, s in zip(reservations, sums, strict=True):  # refused before any is used
        if res.arena is not c._arena:
            raise InvalidArgument("a reservation of another client (or an earlier connection)")
        if res.done:
            raise InvalidArgument(f"reservation {res.id} was already committed or aborted")
        if s is not None and not 0 <= s < 1 << 64:
            raise InvalidArgument(f"checksum {s} of reservation {res.id} is not a u64")
    reqs = [
        pb.CommitRequest(reservation_id=res.id, payload_checksum=res.closing(s))
        for res, s in zip(reservations, sums, strict=True)
    ]
    base = timeout if timeout is not None else c.timeout
    out: builtins.list[PutStatus | KVStoreError] = []
    for i in range(0, len(reqs), MAX_RESERVE_BATCH):
        batch = reqs[i : i + MAX_RESERVE_BATCH]
        # A server with verify_reads off hashes every payload of the batch: allow for it
        # (1 GB/s at worst).
        nbytes = sum(r.header.stored_size for r in reservations[i : i + MAX_RESERVE_BATCH])
        try:
            r = yield Call("CommitMany", pb.CommitManyRequest(commits=batch), base + nbytes / 1e9)
        except BaseException:
            for q in reqs[i + len(batch) :]:  # never sent: give back
                yield from finish(q.reservation_id, False, None, timeout)
            raise
        if len(r.responses) != len(batch):
            raise ServerError(f"CommitMany answered {len(r.responses)} of {len(batch)}")
        out += [
            error_from_code(one.error_code, one.error, "Commit", c.url)
            if one.error_code
            else status_from_pb(one.status)
            for one in r.responses
        ]
    return out


def finish(
    reservation_id: int, commit: bool, checksum: int | None, timeout: float | None
) -> Plan[PutStatus]:
    """Commit one reservation (its status), or abort it (EXISTS: not stored by it)."""
    if commit:
        req = pb.CommitRequest(reservation_id=reservation_id, payload_checksum=checksum)
        return status_from_pb((yield Call("Commit", req, timeout)).status)
    try:
        yield Call("Abort", pb.AbortRequest(reservation_id=reservation_id), timeout)
    except KVStoreError:
        pass  # it expires on its own
    return PutStatus.EXISTS


def abort(res: ReservationBase, timeout: float | None) -> Plan[None]:
    if not res.done:
        res.done = True
        yield from finish(res.id, False, None, timeout)
