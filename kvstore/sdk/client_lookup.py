"""The lookup plans: ``lookup``, and a lookup that lends what it found (``lookup_lend``),
taken by another client (``adopt``) so the load that follows needs no call of its own.

An engine looks a prompt up in its scheduler, then its worker loads the chunks found:
with ``lookup_lend`` the Lookup also lends the matched chunks the worker will load (those
in L1, and in L2 where the worker reads its file in place), so the worker copies at once
instead of asking for leases in an AcquireMany of its own, a round trip it would wait
for with the step (or the request) waiting on it. On a busy host that call took 0.7-3 ms
of a 5-8 ms load, where the server's part of it is 0.2 ms (docs/performance.md).

The leases are lent to a session named by the caller (``holder``), so another client
(the worker's, in another thread or process of the same host) can take them
(``adopt``) and end them in that session's name. A holder without a Session stream is
renewed by nobody: a lease no load ever takes lives ``lease_ms`` at most.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvstore.errors import KVStoreError, ServerError
from kvstore.keys import token_view
from kvstore.protocol import lookup_from_pb, lookup_to_pb
from kvstore.records import parse_header
from kvstore.sdk.base import LEASE_MARGIN, ClientBase
from kvstore.sdk.chunks import NamespaceLike, Tokens, namespace_fingerprint
from kvstore.sdk.client_core import (
    NEED_ARENA,
    Call,
    Plan,
    ReleaseLater,
    Tell,
    by_holder,
    info,
)
from kvstore.sdk.shm import LeaseBase, LentLease
from kvstore.types import LookupResult
from kvstore.v1 import kvstore_pb2 as pb

L = TypeVar("L", bound=LeaseBase)


def lookup(
    c: ClientBase,
    namespace: NamespaceLike,
    tokens: Tokens,
    min_tokens: int = 0,
    granularity: int = 0,
    explain: bool = False,
    repeat: bool = False,
    timeout: float | None = None,
    prefetch: bool = False,
    reads_disk: bool = False,
) -> Plan[LookupResult]:
    args = (namespace, tokens, min_tokens, granularity, explain, repeat, prefetch, reads_disk)
    return lookup_from_pb((yield from lookup_pb(c, *args, timeout=timeout)))


def lookup_pb(
    c: ClientBase,
    namespace: NamespaceLike,
    tokens: Tokens,
    min_tokens: int,
    granularity: int,
    explain: bool,
    repeat: bool,
    prefetch: bool,
    reads_disk: bool,
    *,
    timeout: float | None,
    lend_from: int | None = None,
    holder: str = "",
) -> Plan[pb.LookupResponse]:
    """By chunk keys where the server takes them (``ClientBase._lookup_request``); where
    the answer says the partial match needs one chunk's sub-hashes, asked again with
    them, and by token ids if the store changed in between (a third ask, seldom).
    ``lend_from``: the answer lends the matched chunks from that token on to ``holder``
    (the server lends on the ask it answers in full only)."""
    if c._info is None and c.lookup_by_keys and not explain:
        yield from info(c, timeout)  # its chunking, to key the prompt as the server does
    tb = token_view(tokens)
    args = (namespace, tb, min_tokens, granularity, explain, repeat, prefetch, reads_disk)
    presence, known = c._presence, c._info
    fp, named = namespace_fingerprint(namespace)
    use_filter = known is not None and not explain and c.use_presence and c._shm_pref is not False
    if known is not None and use_filter:
        presence.follow(known)
        got = presence.answer(fp, tb, named is not None, not repeat)
        if got == "stale":  # the server restarted, or stopped: what does it offer now?
            presence.follow((yield from info(c, timeout)))
            got = presence.answer(fp, tb, named is not None, not repeat)
        if got == "absent":  # what the server would answer: nothing matched at chunk 0
            if (counts := presence.due()) is not None:
                told = pb.LookupRequest(fingerprint=fp, repeat=True)  # matches nothing
                told.filtered_lookups, told.filtered_tokens = counts
                yield Tell("Lookup", told)
            return lookup_to_pb(LookupResult(0, len(tb) // 4, stop="not_stored", stop_chunk=0))

    def ask(by_keys: bool = True) -> pb.LookupRequest:
        req = c._lookup_request(*args, by_keys=by_keys)
        if lend_from is not None:
            req.lend_from, req.lend_to, req.client_reads_disk = lend_from, holder, reads_disk
        return req

    req = ask()
    counts = presence.asked(fp, named is not None) if use_filter else (0, 0)
    req.filtered_lookups, req.filtered_tokens = counts
    try:
        r = yield Call("Lookup", req, timeout)
    except KVStoreError:
        presence.unasked(counts)  # they ride on the next Lookup
        raise
    if r.HasField("needs_sub_hashes") and req.chunk_keys:
        again = pb.LookupRequest()
        again.CopyFrom(req)
        again.sub_hashes = c._sub_hashes_of(tb, r.needs_sub_hashes)
        again.sub_hashes_of = r.needs_sub_hashes
        r = yield Call("Lookup", again, timeout)
        if r.HasField("needs_sub_hashes"):  # it stopped elsewhere this time
            r = yield Call("Lookup", ask(by_keys=False), timeout)
    return r


def lookup_lend(
    c: ClientBase,
    namespace: NamespaceLike,
    tokens: Tokens,
    lend_from: int,
    holder: str,
    min_tokens: int,
    granularity: int,
    repeat: bool,
    prefetch: bool,
    reads_disk: bool,
    timeout: float | None,
) -> Plan[tuple[LookupResult, builtins.list[LentLease | None]]]:
    """A lookup that lends the matched chunks from token ``lend_from`` on to ``holder``
    (default: this client's session): per matched chunk a ``LentLease``, or None where
    nothing was lent (before ``lend_from``, below what can be lent without a read, or
    the server lends nothing: another host, shm off)."""
    holder = holder or c.session_id
    t0 = c._clock()
    args = (namespace, tokens, min_tokens, granularity, False, repeat, prefetch, reads_disk)
    r = yield from lookup_pb(c, *args, timeout=timeout, lend_from=lend_from, holder=holder)
    result = lookup_from_pb(r)
    out: builtins.list[LentLease | None] = [None] * len(result.chunks)
    if not r.lent:
        return result, out
    if len(r.lent) != len(out):
        yield ReleaseLater(tuple(a.lease_id for a in r.lent if a.found), (), holder)
        raise ServerError(f"Lookup lent {len(r.lent)} answers for {len(out)} matched chunks")
    for i, (m, a) in enumerate(zip(result.chunks, r.lent, strict=True)):
        if a.found:
            until = t0 + a.expires_ms / 1000 * LEASE_MARGIN
            spans = tuple((e.offset, e.length) for e in a.extents)
            out[i] = LentLease(
                bytes(m.key), a.lease_id, a.header, spans, a.payload_offset, a.on_disk,
                until, holder, (r.lent_arena, r.lent_arena_inode),
            )  # fmt: skip
    return result, out


def adopt(
    c: ClientBase, lent: Sequence[LentLease], make: Callable[..., L]
) -> Plan[builtins.list[L | None]]:
    """Leases another client's lookup lent, as leases of this client (built by ``make``
    as ``acquire_many`` builds them), ended in their holder's name: per lease one, or
    None where this client cannot read it (no arena here, another arena than the one it
    was lent in, L2's file not mapped here, past its ``valid_until``, a bad header or
    extents): acquire that chunk instead, and end the lease (``release_lent``)."""
    arena = yield NEED_ARENA
    out: builtins.list[L | None] = []
    now = c._clock()
    for x in lent:
        if arena is None or c._arena_id is None or x.arena != c._arena_id[:2]:
            out.append(None)  # the server restarted (or no plane here)
            continue
        view = c._disk_view() if x.on_disk else arena
        try:
            if view is None:
                raise KVStoreError("L2's file is not mapped here")
            if now >= x.valid_until:  # its holder renews nothing: it may have run out
                raise KVStoreError(f"lease {x.lease_id} may have expired")
            header = parse_header(x.header, expect_key=x.key)
            extents = c._in_view(list(x.extents), disk=x.on_disk)
        except KVStoreError:
            out.append(None)
            continue
        lease = make(header, x.lease_id, extents, x.payload_offset, view, valid_until=x.valid_until)
        lease.holder = x.holder
        out.append(lease)
    return out


def release_lent(lent: Sequence[LentLease]) -> Plan[None]:
    """End leases a lookup lent that no load will take, without taking them (no arena
    needed): one Release per holder, not waited for."""
    for holder, ids in by_holder((x.holder, x.lease_id) for x in lent).items():
        yield ReleaseLater(tuple(ids), (), holder)
