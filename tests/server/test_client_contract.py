"""One contract suite, run against both clients: ``kvstore.Client`` and ``kvstore.AsyncClient``.

Both drive the same operations of the client core (``kvstore.sdk.client_core``), so they
must answer alike: each test is one coroutine body, run by ``asyncio.run`` against
an ``AsyncClient`` as it is and against a ``Client`` behind ``Awaited`` (its calls made
awaitable, nothing else changed), the way tests/tiers/test_contract.py runs one suite
over every tier. The servers are real kvstore-server processes: the shared one of
tests/server/conftest.py, and servers of their own where a test needs flags (tenants,
a tiny arena) or a restart. ``plane`` is how the bytes travel: ``shm`` (the Unix
socket, shared memory) or ``grpc`` (TCP, streamed). Over the Unix socket the two
clients' unary calls take both transports: ``Client``'s go by the server's express
plane, ``AsyncClient``'s by gRPC (tests/server/test_express.py checks which).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import kvstore
from kvstore.arena import ArenaView
from kvstore.errors import (
    CorruptRecord,
    InvalidArgument,
    KVStoreError,
    NamespaceNotRegistered,
    NotFound,
    PermissionDenied,
)
from kvstore.keys import ROOT, Namespace
from kvstore.sdk import ScatterBatch
from kvstore.sdk import client_core as core
from kvstore.sdk import client_writes as writes
from kvstore.sdk.client import chunk_header
from kvstore.sdk.shm import AsyncReservation, LeaseBase, ReservationBase
from kvstore.testing.redis import RedisServer, available
from kvstore.testing.server import KVServer
from kvstore.types import PutStatus
from kvstore.v1 import kvstore_pb2 as pb
from tests.server.helpers import memory_detail, namespace, payload, shape_for, tokens

MiB = 1 << 20
Body = Callable[[Any], Awaitable[Any]]
CLIENTS = ["Client", "AsyncClient"]
PLANES = ["shm", "grpc"]


# -- driving both clients with one body -------------------------------------------------


class _AwaitedLease:
    """A ``Lease`` with ``AsyncLease``'s face."""

    def __init__(self, lease: Any) -> None:
        self._lease = lease

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lease, name)

    async def release(self) -> bool:
        return bool(self._lease.release())

    async def __aenter__(self) -> _AwaitedLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._lease.__exit__(*exc)


class _AwaitedReservation:
    """A ``Reservation`` with ``AsyncReservation``'s face (its own ``with`` exit aborts)."""

    def __init__(self, res: Any) -> None:
        self._res = res

    def __getattr__(self, name: str) -> Any:
        return getattr(self._res, name)

    async def commit(self, checksum: int | None = None) -> PutStatus:
        return self._res.commit(checksum)

    async def abort(self) -> None:
        self._res.abort()

    async def __aenter__(self) -> _AwaitedReservation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._res.__exit__(*exc)


def _wrap(value: Any) -> Any:
    if isinstance(value, LeaseBase):
        return _AwaitedLease(value)
    if isinstance(value, ReservationBase):
        return _AwaitedReservation(value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _unwrap(value: Any) -> Any:
    if isinstance(value, (_AwaitedLease, _AwaitedReservation)):
        return value._lease if isinstance(value, _AwaitedLease) else value._res
    if type(value) in (list, tuple):  # not a NamedTuple (a LentLease)
        return type(value)(_unwrap(v) for v in value)
    return value


class Awaited:
    """A blocking ``Client`` whose methods are awaited like ``AsyncClient``'s: each call
    is made as is (blocking the test's loop, which has nothing else to do), its result
    returned from a coroutine; ``list`` is an async iterator; leases and reservations
    get awaitable ``release``/``commit``/``abort``. Attributes pass through."""

    def __init__(self, client: kvstore.Client) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if not callable(attr) or inspect.isclass(attr):
            return attr

        @functools.wraps(attr)
        async def call(*args: Any, **kw: Any) -> Any:
            return _wrap(attr(*_unwrap(args), **{k: _unwrap(v) for k, v in kw.items()}))

        return call

    async def _aiter(self, it: Iterator[Any]) -> AsyncIterator[Any]:
        for v in it:
            yield v

    def list(self, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        return self._aiter(self.client.list(*args, **kw))


class Drive:
    """Runs a test body against one kind of client (``kind``): ``drive(body, url=...)``."""

    def __init__(self, kind: str, server: KVServer) -> None:
        self.kind, self.server = kind, server

    def url(self, plane: str, server: KVServer | None = None) -> str:
        srv = server or self.server
        return srv.unix_url if plane == "shm" else srv.tcp_url

    def __call__(
        self, body: Body, plane: str = "shm", *, server: KVServer | None = None, **kw: Any
    ) -> Any:
        url = kw.pop("url", None) or self.url(plane, server)
        kw.setdefault("shm", plane == "shm")
        kw.setdefault("timeout", 30)
        return asyncio.run(self.run(body, url, **kw))

    async def run(self, body: Body, url: str, **kw: Any) -> Any:
        if self.kind == "Client":
            with kvstore.Client(url, **kw) as c:
                return await body(Awaited(c))
        async with kvstore.AsyncClient(url, **kw) as a:
            return await body(a)


@pytest.fixture(params=CLIENTS)
def drive(request: pytest.FixtureRequest, server: KVServer) -> Drive:
    return Drive(request.param, server)


async def _collect(it: AsyncIterator[Any]) -> list[Any]:
    return [v async for v in it]


def memory_detail_of(stats: Any) -> dict[str, Any]:
    """The L1 tier's detail in the server's stats (active_leases, reservations, pages_used)."""
    return stats.tiers[0].detail


def _client(kv: Any) -> Any:
    """The client under a test body's ``kv``, for the few tests that look inside."""
    return kv.client if isinstance(kv, Awaited) else kv


# -- server ---------------------------------------------------------------------------


@pytest.mark.parametrize("plane", PLANES)
def test_info_health_and_stats(drive: Drive, plane: str) -> None:
    async def body(kv: Any) -> None:
        info = await kv.info()
        assert info.chunk_tokens > 0 and info.max_chunk_bytes > 0, info
        assert info.shm_path and info.shm_size >= 64 * MiB and info.lease_ms > 0, info
        assert not info.auth_required, info
        assert await kv.health() is True, "the server answers SERVING"
        stats = await kv.stats()
        assert [t.name for t in stats.tiers][:2] == ["memory", "disk"], stats.tiers
        assert {"active_leases", "uptime_s"} <= set(stats.extra), stats.extra
        assert stats.extra["uptime_s"] >= 0

    drive(body, plane)


def test_shm_active_means_the_same_in_both(drive: Drive) -> None:
    """Set up on first use: asked before any call, it maps the arena if it may."""

    async def body(kv: Any) -> bool:
        first = kv.shm_active  # no call made before
        assert kv.shm_active is first, "asking again changes nothing"
        return bool(first)

    assert drive(body, "shm", shm=None) is True, "same host, shm=None: shared memory"
    assert drive(body, "grpc", shm=None) is True, "over TCP on the same host too"
    assert drive(body, "shm", shm=False) is False, "shm=False never maps"

    async def no_arena(kv: Any) -> None:
        assert kv.shm_active is False
        with pytest.raises(KVStoreError, match="shared-memory data plane"):
            await kv.acquire(b"\x01" * 32)
        with pytest.raises(KVStoreError, match="shared-memory data plane"):
            await kv.reserve([])

    drive(no_arena, "grpc")


# -- put and get ------------------------------------------------------------------------


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("nbytes", [512, MiB + 4096, 32 * MiB], ids=["512B", "1MiB+", "32MiB"])
def test_put_get_byte_exact(drive: Drive, plane: str, nbytes: int) -> None:
    n_tok = 256
    bpt = nbytes // n_tok
    ns = namespace(f"contract-rt-{drive.kind}-{plane}", bpt)
    data = payload(n_tok * bpt, seed=nbytes)

    async def body(kv: Any) -> None:
        key, status = await kv.put_chunk(
            ns, ROOT, tokens(n_tok), data, "bfloat16", shape_for(n_tok, bpt)
        )
        assert status == PutStatus.STORED, f"{plane}: put returned {status}"
        assert kv.shm_active is (plane == "shm"), f"data plane is not {plane}"

        got = await kv.get(key)
        assert got is not None, f"{plane}: stored chunk not found"
        header, blob = got
        assert header.key == key and header.shape == shape_for(n_tok, bpt)
        assert header.payload_checksum == xxhash.xxh3_64_intdigest(data.data), "sealed wrongly"
        assert blob == data.tobytes(), f"{plane}: get returned different bytes"

        out = np.zeros(data.size + 7, dtype=np.uint8)  # larger buffers are fine
        h2 = await kv.get_into(key, out)
        assert h2 is not None and h2.key == key
        assert np.array_equal(out[: data.size], data), f"{plane}: get_into wrote other bytes"

        again = await kv.put_chunk(ns, ROOT, tokens(n_tok), data, "bfloat16", shape_for(n_tok, bpt))
        assert again == (key, PutStatus.EXISTS), f"second put of the same chunk: {again}"

    drive(body, plane)


@pytest.mark.parametrize("plane", PLANES)
def test_put_of_a_sealed_header(drive: Drive, plane: str) -> None:
    ns = namespace(f"contract-put-{drive.kind}-{plane}", 64)
    data = payload(16 * 64, seed=41)
    header = chunk_header(ns, ROOT, tokens(16, 41), data, "bfloat16", (16, 32))

    async def body(kv: Any) -> None:
        assert await kv.put(header, data) == PutStatus.STORED
        assert await kv.put(header, data) == PutStatus.EXISTS
        got = await kv.get(header.key)
        assert got is not None and got == (header, data.tobytes()), got

    drive(body, plane)


@pytest.mark.parametrize("plane", PLANES)
def test_miss_and_small_buffer(drive: Drive, plane: str) -> None:
    ns = namespace(f"contract-small-{drive.kind}-{plane}", 64)

    async def body(kv: Any) -> None:
        assert await kv.get(b"\x01" * 32) is None, "unknown key must be a miss"
        assert await kv.get_into(b"\x02" * 32, bytearray(16)) is None
        key, _ = await kv.put_chunk(ns, ROOT, tokens(16), payload(1024, 3), "bfloat16", (16, 32))
        with pytest.raises(InvalidArgument, match="output buffer"):
            await kv.get_into(key, bytearray(100))
        with pytest.raises(InvalidArgument, match="read-only"):
            await kv.get_into(key, b"\0" * 2048)

    drive(body, plane)


@pytest.mark.parametrize("plane", PLANES)
def test_a_chunk_larger_than_l1_goes_through_disk(
    drive: Drive, plane: str, make_server: Callable[..., KVServer]
) -> None:
    """L1 cannot take or lend it: puts stage it for L2 (the Reserve answers TOO_LARGE and
    the put streams instead), gets stream it from there."""
    srv = make_server("tiny", memory="4MiB").start()
    ns = namespace(f"contract-big-{drive.kind}-{plane}", 24 * 1024)
    data = payload(256 * 24 * 1024, 77)  # 6 MiB > the 4 MiB arena

    async def body(kv: Any) -> None:
        key, status = await kv.put_chunk(
            ns, ROOT, tokens(256, 5000), data, "bfloat16", (256, 12 * 1024)
        )
        assert status == PutStatus.STORED, f"{plane}: {status}"
        assert await kv.exists([key]) == [(2,)], "the chunk should live in L2 only"
        got = await kv.get(key)
        assert got is not None and got[1] == data.tobytes(), f"{plane}: wrong bytes"
        out = np.empty_like(data)
        assert await kv.get_into(key, out) is not None and np.array_equal(out, data)

    drive(body, plane, server=srv)
    assert srv.stop() == 0, srv.log()


def _spy(kv: Any, seen: list[tuple[str, Any]]) -> None:
    """Record each RPC the client's core asks its transport for (nothing else changes)."""
    client = _client(kv)
    step = client._step

    def spied(s: core.Step) -> Any:
        if isinstance(s, core.Call):
            seen.append((s.method, s.request))
        elif isinstance(s, core.GetStream):
            seen.append(("Get", s.request))
        return step(s)

    client._step = spied


def test_both_clients_send_the_same_rpcs(drive: Drive) -> None:
    """Through shared memory a put_chunk is ReserveMany + Commit carrying the checksum the
    copy computed (the client does not hash it first), a get_into one Acquire (its
    Release is not waited for); streamed, a put is one Put and a get one Get."""
    bpt = 1024
    ns = namespace(f"contract-rpcs-{drive.kind}", bpt)
    data = payload(64 * bpt, seed=5)
    out = np.empty_like(data)

    async def body(kv: Any) -> list[str]:
        shm = kv.shm_active  # the plane is set up (its Info made) before the spy
        seen: list[tuple[str, Any]] = []
        _spy(kv, seen)
        key, status = await kv.put_chunk(ns, ROOT, tokens(64, 3), data, "bfloat16", (64, 512))
        assert status == PutStatus.STORED
        assert await kv.get_into(key, out) is not None and np.array_equal(out, data)
        await kv.lookup(ns, tokens(64, 3))
        if shm:
            (reserve,) = [r for m, r in seen if m == "ReserveMany"]
            assert reserve.requests[0].checksum_at_commit, "the put leaves the checksum to Commit"
            (commit,) = [r for m, r in seen if m == "Commit"]
            assert commit.payload_checksum == xxhash.xxh3_64_intdigest(data.data), commit
        return [m for m, _ in seen]

    # Session pings and Releases not waited for are no steps of a plan.
    assert drive(body, "shm") == ["ReserveMany", "Commit", "Acquire", "Lookup"]
    ns = namespace(f"contract-rpcs-{drive.kind}-grpc", bpt)
    assert drive(body, "grpc") == ["Put", "Get", "Lookup"]


# -- lookup and management ----------------------------------------------------------------


def test_lookup(drive: Drive) -> None:
    async def body(kv: Any) -> None:
        ct = (await kv.info()).chunk_tokens
        ns = namespace(f"contract-lookup-{drive.kind}", 64)
        prompt = tokens(4 * ct, start=10_000)
        parent = ROOT
        for i in range(4):  # the chain of the prompt's chunks, each keyed on its parent
            part = prompt[i * ct : (i + 1) * ct]
            data = payload(ct * 64, i)
            parent, status = await kv.put_chunk(ns, parent, part, data, "bfloat16", (ct, 32))
            assert status.ok, status

        async def both(*args: Any, **kw: Any) -> Any:
            """The lookup sent by chunk keys (the default) and by token ids: alike."""
            client = _client(kv)
            client.lookup_by_keys = False
            by_ids = await kv.lookup(*args, **kw)
            client.lookup_by_keys = True
            seen: list[tuple[str, Any]] = []
            _spy(kv, seen)
            answered = client._presence.answered
            by_keys = await kv.lookup(*args, **kw)
            del client._step  # the spy goes
            asked = [r for m, r in seen if m == "Lookup"]
            if client._presence.answered > answered:  # kvstore.presence: a sure miss
                assert not asked and by_keys.matched_tokens == 0, (asked, by_keys)
            else:
                (req,) = asked
                assert req.chunk_keys and not req.token_ids, "the SDK sends keys by default"
            assert by_keys == by_ids, f"by keys {by_keys} != by token ids {by_ids}"
            return by_keys

        full = await both(ns, prompt)
        assert full.matched_tokens == 4 * ct and full.stop == "complete", full
        assert len(full.chunks) == 4 and full.by_tier.get(1) == 4 * ct, full

        # Diverges 40 tokens into the third chunk: 2 chunks + 32 tokens (granularity 16).
        other = prompt.copy()
        other[2 * ct + 40 :] += 1
        part = await both(ns, other)
        assert part.matched_tokens == 2 * ct + 32, part
        assert part.stop == "diverged" and part.chunks[-1].partial, part

        cut = await both(ns, other, granularity=64)
        assert cut.matched_tokens == 2 * ct, "granularity cut"
        assert (await both(ns, prompt[:100], min_tokens=200)).matched_tokens == 0
        short = await both(ns, prompt[: 3 * ct + 100])
        assert short.matched_tokens == 3 * ct + 96 and short.chunks[-1].partial, short
        nothing = namespace(f"contract-lookup-nothing-{drive.kind}", 64)
        assert (await both(nothing, prompt)).matched_tokens == 0
        assert (await both(ns.fingerprint, prompt)).matched_tokens == 4 * ct, "by fingerprint"

        # explain: the same tokens are stored under another namespace.
        res = await kv.lookup(nothing, prompt, explain=True)
        assert res.matched_tokens == 0
        fps = {m.fingerprint: m for m in res.other_namespaces}
        assert ns.fingerprint in fps and fps[ns.fingerprint].matched_tokens == 4 * ct, res
        assert fps[ns.fingerprint].namespace == ns, "server should name namespaces it was told"

        # repeat: answered alike, not counted again.
        before = (await kv.stats()).lookups
        again = await kv.lookup(ns, prompt, repeat=True)
        assert again.matched_tokens == full.matched_tokens, again
        assert (await kv.stats()).lookups == before, "a repeated lookup must not be counted"
        await kv.lookup(ns, prompt)
        assert (await kv.stats()).lookups == before + 1, "a lookup is counted once"

    drive(body, "shm")


def test_a_long_prompt_is_looked_up_by_keys_then_one_chunks_sub_hashes(drive: Drive) -> None:
    """Past ``inline_sub_hashes`` chunks the keys go alone: a full match or a clean miss is
    one Lookup, a stop where a stored chunk shares the parent two (the second with that
    chunk's sub-hashes), and every answer equals the one by token ids."""

    async def body(kv: Any) -> None:
        ct = (await kv.info()).chunk_tokens
        ns = namespace(f"contract-lookup-long-{drive.kind}", 64)
        prompt = tokens(3 * ct, start=20_000)
        parent = ROOT
        for i in range(3):
            part = prompt[i * ct : (i + 1) * ct]
            parent, _ = await kv.put_chunk(
                ns, parent, part, payload(ct * 64, i), "bfloat16", (ct, 32)
            )
        client = _client(kv)
        client.inline_sub_hashes = 0
        diverged = prompt.copy()
        diverged[ct + 70 :] += 7
        for query, calls, matched in (
            (prompt, 1, 3 * ct),
            (np.concatenate([prompt, tokens(ct, 1)]), 1, 3 * ct),  # nothing under chunk 2
            (diverged, 2, ct + 64),
            (prompt[: ct + 40], 2, ct + 32),  # shorter than the stored chunk 1
        ):
            client.lookup_by_keys = False
            want = await kv.lookup(ns, query)
            client.lookup_by_keys = True
            seen: list[tuple[str, Any]] = []
            _spy(kv, seen)
            got = await kv.lookup(ns, query)
            del client._step
            lookups = [r for m, r in seen if m == "Lookup"]
            assert len(lookups) == calls, f"{len(query)} tokens: {len(lookups)} Lookups"
            assert all(r.chunk_keys and not r.token_ids for r in lookups)
            if calls == 2:
                assert not lookups[0].sub_hashes and lookups[1].HasField("sub_hashes_of")
            assert got == want and got.matched_tokens == matched, (got, want)

    drive(body, "shm")


def test_a_store_changed_between_the_two_asks_is_asked_by_token_ids(drive: Drive) -> None:
    """Between the keys-only Lookup and the one with chunk 1's sub-hashes another client
    stores the prompt's chunk 1 and a chunk beside its chunk 2: the second answer asks
    for chunk 2's, and the client asks by token ids instead of a third round of keys."""
    ns = namespace(f"contract-lookup-moved-{drive.kind}", 64)

    async def body(kv: Any) -> None:
        ct = (await kv.info()).chunk_tokens
        query = tokens(3 * ct, start=30_000)
        stored = query.copy()
        stored[ct + 70 :] += 3  # chunk 1 diverges 70 tokens in
        k0, _ = await kv.put_chunk(ns, ROOT, query[:ct], payload(ct * 64, 0), "bfloat16", (ct, 32))
        await kv.put_chunk(ns, k0, stored[ct : 2 * ct], payload(ct * 64, 1), "bfloat16", (ct, 32))
        beside = query[2 * ct :].copy()
        beside[100:] += 5  # chunk 2's neighbour shares its first 100 tokens

        def meanwhile() -> None:
            with kvstore.Client(drive.server.unix_url) as other:
                k1, _ = other.put_chunk(
                    ns, k0, query[ct : 2 * ct], payload(ct * 64, 2), "bfloat16", (ct, 32)
                )
                other.put_chunk(ns, k1, beside, payload(ct * 64, 3), "bfloat16", (ct, 32))

        client = _client(kv)
        client.inline_sub_hashes = 0
        seen: list[tuple[str, Any]] = []
        step = client._step

        def spied(st: core.Step) -> Any:
            if isinstance(st, core.Call) and st.method == "Lookup":
                seen.append((st.method, st.request))
                if len(seen) == 2:
                    meanwhile()
            return step(st)

        client._step = spied
        got = await kv.lookup(ns, query)
        del client._step
        asks = [r for _, r in seen]
        assert [bool(r.chunk_keys) for r in asks] == [True, True, False], asks
        assert asks[1].sub_hashes_of == 1 and asks[2].token_ids
        assert got.matched_tokens == 2 * ct + 96 and got.stop == "diverged", got

    drive(body, "shm")


@pytest.mark.parametrize("plane", PLANES)
def test_management(drive: Drive, plane: str) -> None:
    async def body(kv: Any) -> None:
        ns = namespace(f"contract-mgmt-{drive.kind}-{plane}", 32)
        keys = [ROOT]
        for i in range(3):
            part, data = tokens(256, 50_000 + 256 * i), payload(256 * 32, i)
            key, status = await kv.put_chunk(ns, keys[-1], part, data, "bfloat16", (256, 16))
            assert status.ok, status
            keys.append(key)
        keys = keys[1:]
        found = await kv.exists([*keys, b"\x07" * 32])
        assert all(1 in f for f in found[:3]) and found[3] == (), found

        assert await kv.pin(keys[:2]) == 2
        pinned = await _collect(kv.list(ns, pinned_only=True))
        assert {v.key for v in pinned} == set(keys[:2]), pinned
        listed = await _collect(kv.list(ns, page_size=2))  # paginates: 3 chunks, pages of 2
        assert [v.key for v in listed] == sorted(keys), "list must return every chunk once"
        assert all(v.n_tokens == 256 and v.dtype == "bfloat16" for v in listed)
        assert [v.key async for v in kv.list(ns.fingerprint, tier=1)] == sorted(keys)
        assert await kv.pin(keys[:2], pinned=False) == 2
        assert await _collect(kv.list(ns, pinned_only=True)) == []

        spaces = {n.fingerprint: n for n in await kv.namespaces()}
        assert spaces[ns.fingerprint].chunks == 3
        assert spaces[ns.fingerprint].bytes == 3 * 256 * 32
        assert spaces[ns.fingerprint].namespace is None, "no lookup described it"

        assert await kv.delete([keys[2], b"\x08" * 32]) == 1
        assert await kv.get(keys[2]) is None, "deleted chunk still served"
        assert await kv.clear(ns) == 2
        assert await kv.exists(keys[:2]) == [(), ()], "clear left chunks behind"
        assert await kv.clear(ns) == 0

    drive(body, plane)


def test_clear_all(drive: Drive, make_server: Callable[..., KVServer]) -> None:
    srv = make_server("clear-all", args=["--no-disk"]).start()

    async def body(kv: Any) -> None:
        for tag in ("a", "b"):
            ns = namespace(f"contract-all-{tag}", 64)
            await kv.put_chunk(ns, ROOT, tokens(16), payload(1024, 9), "bfloat16", (16, 32))
        assert await kv.clear(all=True) == 2
        assert (await kv.stats()).chunks == 0

    drive(body, "shm", server=srv)
    assert srv.stop() == 0, srv.log()


# -- writing in place: reserve, write the views, commit -----------------------------------


def test_reserve_writes_in_place_and_the_server_seals(drive: Drive) -> None:
    """One round trip reserves a batch; what is written into the views is what a get
    returns, and the checksum the server computed at Commit is the payload's."""
    bpt = 4096
    ns = namespace(f"contract-reserve-{drive.kind}", bpt)
    datas = [payload(256 * bpt, seed=100 + i) for i in range(3)]
    headers, parent = [], ROOT
    for i in range(3):
        h = chunk_header(ns, parent, tokens(256, 256 * i), None, "bfloat16", shape_for(256, bpt))
        headers.append(h)
        parent = h.key

    async def body(kv: Any) -> None:
        first = await kv.put_chunk(ns, ROOT, tokens(256), datas[0], "bfloat16", shape_for(256, bpt))
        assert first[1] == PutStatus.STORED
        got = await kv.reserve(headers)
        assert got[0] == PutStatus.EXISTS, "a stored chunk needs no reservation"
        for res, data in zip(got[1:], datas[1:], strict=True):
            assert isinstance(res, AsyncReservation | _AwaitedReservation), res
            assert await kv.get(res.header.key) is None, "nothing is visible before commit"
            view = res.contiguous()
            assert view is not None, "a fresh arena hands out one extent per record"
            view[:] = data
            assert await res.commit() == PutStatus.STORED
        for h, data in zip(headers, datas, strict=True):
            found = await kv.get(h.key)
            assert found is not None and found[1] == data.tobytes(), "other bytes came back"
            assert found[0].payload_checksum == xxhash.xxh3_64_intdigest(data.data), (
                "the server must seal the record with the checksum of what was written"
            )
        assert memory_detail_of(await kv.stats())["reservations"] == 0

    drive(body, "shm")


def test_a_reservation_left_unwritten_is_given_back(drive: Drive) -> None:
    ns = namespace(f"contract-abort-{drive.kind}", 512)
    h = chunk_header(ns, ROOT, tokens(64), None, "bfloat16", shape_for(64, 512))
    h2 = chunk_header(ns, ROOT, tokens(64, 64), None, "bfloat16", shape_for(64, 512))

    async def body(kv: Any) -> None:
        before = memory_detail_of(await kv.stats())["pages_used"]
        (res,) = await kv.reserve([h])
        assert memory_detail_of(await kv.stats())["pages_used"] > before
        with pytest.raises(RuntimeError):
            async with res:
                raise RuntimeError("the device copy failed")
        detail = memory_detail_of(await kv.stats())
        assert (detail["reservations"], detail["pages_used"]) == (0, before), (
            "leaving the with-block without commit must abort the reservation"
        )
        assert await kv.get(h.key) is None
        (res,) = await kv.reserve([h2])
        await res.abort()
        assert res.done and memory_detail_of(await kv.stats())["reservations"] == 0
        with pytest.raises(InvalidArgument, match="already committed or aborted"):
            await res.commit()

    drive(body, "shm")


def test_a_reservation_past_its_time_hands_out_no_pages(drive: Drive) -> None:
    """Past ``valid_until`` (half the server's lease) a reservation may have expired and
    its pages gone to a put already acknowledged: a slow writer (a stalled engine step,
    a late device copy) must not write there. Before, views and write handed the pages
    out at any time."""
    ns = namespace(f"contract-expired-{drive.kind}", 512)
    h = chunk_header(ns, ROOT, tokens(64, 128), None, "bfloat16", shape_for(64, 512))

    async def body(kv: Any) -> None:
        (res,) = await kv.reserve([h])
        inner = getattr(res, "_res", res)
        assert inner.contiguous() is not None, "a live reservation hands out its pages"
        inner._clock = lambda: inner.valid_until  # the client can no longer be sure
        with pytest.raises(NotFound, match="may have expired"):
            res.contiguous()
        with pytest.raises(NotFound, match="may have expired"):
            res.write(payload(64 * 512, seed=7))
        await res.abort()
        assert memory_detail_of(await kv.stats())["reservations"] == 0
        assert await kv.get(h.key) is None

    drive(body, "shm")


def test_bytes_that_do_not_match_their_checksum_are_never_served(drive: Drive) -> None:
    """Given up front (a sealed header), or computed by the writer before a stray write:
    either way nothing is served. The server does not hash the pages at commit (every
    read of them does, this client's included), so the commit stores them and the first
    read finds them bad: a miss, counted, the chunk deleted."""
    ns = namespace(f"contract-bad-{drive.kind}", 512)
    data = payload(64 * 512, seed=5)
    sealed = chunk_header(ns, ROOT, tokens(64), data, "bfloat16", shape_for(64, 512))
    placeholder = chunk_header(ns, ROOT, tokens(64, 64), None, "bfloat16", shape_for(64, 512))

    async def body(kv: Any) -> None:
        # Counted by whichever read finds it first: this get, or the server's write-down
        # copy, which may run the moment the commit is answered.
        corrupt = (await kv.stats()).tiers[0].corrupt
        (res,) = await kv.reserve([sealed], checksum_at_commit=False)
        bad = data.copy()
        bad[-1] ^= 1
        res.write(bad)
        assert await res.commit() == PutStatus.STORED
        assert await kv.get(sealed.key) is None, "bytes failing their checksum were served"
        assert (await kv.stats()).tiers[0].corrupt == corrupt + 1, "the bad chunk went uncounted"
        assert not any(await kv.exists([sealed.key])), "a chunk found bad must be forgotten"

        (res,) = await kv.reserve([placeholder])
        view = res.contiguous()
        assert view is not None
        view[:] = data
        view[100] ^= 0xFF  # the stray write
        assert await res.commit(xxhash.xxh3_64_intdigest(data.data)) == PutStatus.STORED
        assert await kv.get(placeholder.key) is None, "bytes failing the writer's sum were served"

    drive(body, "shm")


def test_commit_many_stores_each_chunk_on_its_own(drive: Drive) -> None:
    """One CommitMany for a batch: the good chunks are stored, the one whose header a
    stray write overwrote is refused alone, with the error a single commit would raise."""
    ns = namespace(f"contract-commit-many-{drive.kind}", 512)
    datas = [payload(64 * 512, seed=200 + i) for i in range(3)]
    headers = [
        chunk_header(ns, ROOT, tokens(64, 64 * i), None, "bfloat16", shape_for(64, 512))
        for i in range(3)
    ]

    async def body(kv: Any) -> None:
        held = await kv.reserve(headers)
        sums = []
        for res, data in zip(held, datas, strict=True):
            view = res.contiguous()
            assert view is not None
            view[:] = data
            sums.append(xxhash.xxh3_64_intdigest(data.data))
        header_at = held[1]._extents[0][0]
        held[1].arena.array[header_at + 8] ^= 0xFF  # the stray write, into its header
        got = await kv.commit(held, sums)
        assert got[0] == got[2] == PutStatus.STORED, got
        assert isinstance(got[1], CorruptRecord), f"the damaged chunk must fail alone: {got}"
        assert await kv.get(headers[0].key) is not None
        assert await kv.get(headers[2].key) is not None
        assert await kv.get(headers[1].key) is None
        assert memory_detail_of(await kv.stats())["reservations"] == 0
        with pytest.raises(InvalidArgument, match="already committed"):
            await kv.commit([held[0]])
        (again,) = await kv.reserve(
            [chunk_header(ns, ROOT, tokens(64, 999), None, "bfloat16", shape_for(64, 512))]
        )
        with pytest.raises(InvalidArgument, match="twice"):
            await kv.commit([again, again])
        with pytest.raises(InvalidArgument, match="checksums for"):
            await kv.commit([again], [1, 2])
        with pytest.raises(InvalidArgument, match="not a u64"):
            await kv.commit([again], [1 << 64])
        assert not again.done, "a refused batch must not use up its reservations"
        again.write(payload(64 * 512, seed=999))
        assert await kv.commit([again]) == [PutStatus.STORED], "hashed while written"

    drive(body, "shm")


def _chain(ns: Namespace, n: int, bpt: int, seed: int, *, sealed: bool = False) -> Any:
    """``n`` chained chunks of 64 tokens: (headers, payloads); the headers' checksums are
    placeholders unless ``sealed``."""
    parent, headers, datas = ROOT, [], []
    for i in range(n):
        data = payload(64 * bpt, seed + i)
        h = chunk_header(
            ns, parent, tokens(64, seed + 64 * i), data if sealed else None, "bfloat16",
            (64, bpt // 2),
        )  # fmt: skip
        headers.append(h)
        datas.append(data)
        parent = h.key
    return headers, datas


def _spy_steps(kv: Any, seen: list[str]) -> None:
    """Record each step of a plan: a call by its method, a pipe's sends by theirs."""
    client = _client(kv)
    step = client._step

    def spied(s: core.Step) -> Any:
        if isinstance(s, core.Call):
            seen.append(s.method)
        elif isinstance(s, core.Send):
            seen.append(f"Send {s.call.method}")
        elif isinstance(s, core.Receive):
            seen.append("Receive")
        return step(s)

    client._step = spied


@pytest.mark.parametrize("plane", PLANES)
def test_put_many_pipelines_a_batch_in_few_calls(drive: Drive, plane: str) -> None:
    """64 chunks, 8 stored already: through shared memory over the express plane
    (``Client``) 4 ReserveMany and 4 CommitMany in the server's counts (no Put, no
    Commit), every ReserveMany sent before the first answer is read: the server reserves
    the next part while this client copies one. Over gRPC (``AsyncClient``) one part:
    a call there costs more than the overlap saves. Streamed (no arena), each chunk is
    one Put. The bytes read back; sealed headers go the same way."""
    bpt = 1024
    ns = namespace(f"contract-put-many-{drive.kind}-{plane}", bpt)
    headers, datas = _chain(ns, 64, bpt, seed=81_000)

    async def body(kv: Any) -> None:
        first = await kv.put_many(headers[:8], datas[:8], checksum_at_commit=True)
        assert first == [PutStatus.STORED] * 8, first
        before = await kv.stats()
        seen: list[str] = []
        _spy_steps(kv, seen)
        got = await kv.put_many(headers, datas, checksum_at_commit=True)
        steps = list(seen)
        assert got == [PutStatus.EXISTS] * 8 + [PutStatus.STORED] * 56, got
        counts = _delta(
            _requests(await kv.stats()), _requests(before),
            "ReserveMany", "CommitMany", "Commit", "Put",
        )  # fmt: skip
        parts = 4 if drive.kind == "Client" else 1
        if kv.shm_active:
            assert counts == {
                "ReserveMany": parts, "CommitMany": parts, "Commit": 0, "Put": 0
            }, counts  # fmt: skip
            assert steps[: parts + 1] == ["Send ReserveMany"] * parts + ["Receive"], (
                f"the parts' reservations must all be on their way before the first "
                f"answer is read: {steps}"
            )
        else:
            # As put: each chunk streamed, the server answering EXISTS for those it has.
            assert counts == {"ReserveMany": 0, "CommitMany": 0, "Commit": 0, "Put": 64}, counts
        for i in (0, 9, 33, 63):
            one = await kv.get(headers[i].key)
            assert one is not None and one[1] == datas[i].tobytes(), f"chunk {i}: wrong bytes"

        sealed, sdatas = _chain(ns, 6, bpt, seed=82_000, sealed=True)
        assert await kv.put_many(sealed, sdatas) == [PutStatus.STORED] * 6
        one = await kv.get(sealed[5].key)
        assert one is not None and one[1] == sdatas[5].tobytes()
        with pytest.raises(InvalidArgument, match="2 payloads for 3 headers"):
            await kv.put_many(sealed[:3], sdatas[:2])
        assert await kv.put_many([], []) == []
        assert memory_detail_of(await kv.stats())["reservations"] == 0
        await kv.clear(ns)

    drive(body, plane)


def test_put_many_streams_what_l1_cannot_take(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """A 6 MiB chunk in a batch for a 4 MiB arena: its reservation answers TOO_LARGE and
    it is streamed to L2, the chunks beside it stored in L1."""
    srv = make_server("tiny-many", memory="4MiB").start()
    bpt = 24 * 1024
    ns = namespace(f"contract-put-many-big-{drive.kind}", bpt)
    small = [payload(64 * bpt, 91 + i) for i in range(2)]  # 1.5 MiB each
    big = payload(256 * bpt, 90)
    headers = [
        chunk_header(ns, ROOT, tokens(64, 0), None, "bfloat16", (64, bpt // 2)),
        chunk_header(ns, ROOT, tokens(256, 5000), None, "bfloat16", (256, bpt // 2)),
        chunk_header(ns, ROOT, tokens(64, 64), None, "bfloat16", (64, bpt // 2)),
    ]

    async def body(kv: Any) -> None:
        got = await kv.put_many(headers, [small[0], big, small[1]], checksum_at_commit=True)
        assert got == [PutStatus.STORED] * 3, got
        assert await kv.exists([h.key for h in headers]) == [(1, 2), (2,), (1, 2)] or (
            (await kv.exists([headers[1].key])) == [(2,)]
        ), "the big chunk should live in L2 only"
        one = await kv.get(headers[1].key)
        assert one is not None and one[1] == big.tobytes(), "the streamed chunk's bytes"
        one = await kv.get(headers[2].key)
        assert one is not None and one[1] == small[1].tobytes()

    drive(body, "shm", server=srv)
    assert srv.stop() == 0, srv.log()


def test_put_many_gives_back_what_slow_copies_outlived(drive: Drive) -> None:
    """The client's clock passes the reservations' time at the fifth copy, in the second
    of four parts (``Client``, express) or in the one part (``AsyncClient``): the first
    part is committed (stored) if it was one, put_many raises NotFound, and no
    reservation stays held on the server, those of the parts not reached included."""
    bpt = 1024
    ns = namespace(f"contract-put-many-late-{drive.kind}", bpt)
    headers, datas = _chain(ns, 16, bpt, seed=83_000)

    async def body(kv: Any) -> None:
        await kv.info()
        assert kv.shm_active
        client = _client(kv)
        reads = iter(range(1 << 30))
        # The plan's start (t0) and the first part's 4 writes see time 0; later, the
        # reservations may have expired.
        client._clock = lambda: 0.0 if next(reads) < 5 else 1e9
        with pytest.raises(NotFound, match="may have expired"):
            await kv.put_many(headers, datas, checksum_at_commit=True)
        client._clock = time.monotonic
        found = await kv.exists([h.key for h in headers])
        stored = 4 if drive.kind == "Client" else 0
        assert [bool(f) for f in found] == [True] * stored + [False] * (16 - stored), found
        assert memory_detail_of(await kv.stats())["reservations"] == 0, (
            "reservations of a failed put_many were left to expire"
        )
        await kv.clear(ns)

    drive(body, "shm")


def test_put_many_refused_by_the_server_raises_its_error_and_holds_nothing(
    drive: Drive,
) -> None:
    """Headers whose key is not hash(parent, namespace, tokens), in the second and third
    of four parts (``Client``) or in the one part (``AsyncClient``): the server refuses
    those ReserveMany whole. put_many raises the server's InvalidArgument (before, the
    failure path asked the pipe for one answer too many: IndexError, or AttributeError
    on a CommitMany's), and no reservation stays held, those of the fourth part
    included (before, the third part's refusal stopped the cleanup short of it);
    nothing of those parts is stored."""
    from dataclasses import replace

    bpt = 1024
    ns = namespace(f"contract-put-many-refused-{drive.kind}", bpt)
    headers, datas = _chain(ns, 16, bpt, seed=84_000)
    headers[5] = replace(headers[5], key=b"\x05" * 32)
    headers[9] = replace(headers[9], key=b"\x09" * 32)

    async def body(kv: Any) -> None:
        await kv.info()
        assert kv.shm_active
        with pytest.raises(InvalidArgument, match="key does not match"):
            await kv.put_many(headers, datas, checksum_at_commit=True)
        found = await kv.exists([h.key for h in headers[4:]])
        assert not any(found), f"chunks of the refused part or after it were stored: {found}"
        assert memory_detail_of(await kv.stats())["reservations"] == 0, (
            "reservations of a refused put_many were left to expire"
        )
        await kv.clear(ns)

    drive(body, "shm")


def test_a_reservation_of_another_client_is_refused(drive: Drive) -> None:
    ns = namespace(f"contract-foreign-{drive.kind}", 512)
    h = chunk_header(ns, ROOT, tokens(64), None, "bfloat16", shape_for(64, 512))
    with kvstore.Client(drive.server.unix_url, shm=True) as other:
        (foreign,) = other.reserve([h])
        assert isinstance(foreign, kvstore.sdk.client.Reservation)

        async def body(kv: Any) -> None:
            with pytest.raises(InvalidArgument, match="another client"):
                await kv.commit([foreign])

        drive(body, "shm")
        assert not foreign.done
        foreign.abort()


# -- reading in place: acquire, read the views, release ------------------------------------


def test_acquire_and_release(drive: Drive) -> None:
    ns = namespace(f"contract-lease-{drive.kind}", 4096)
    data = payload(64 * 4096, 11)

    async def body(kv: Any) -> None:
        key, _ = await kv.put_chunk(ns, ROOT, tokens(64, 7), data, "bfloat16", (64, 2048))
        base = (await kv.stats()).extra["active_leases"]
        lease = await kv.acquire(key)
        assert lease is not None and lease.header.key == key
        async with lease:
            joined = b"".join(bytes(v) for v in lease.views())
            assert joined == data.tobytes(), "lease views show other bytes"
            out = np.empty_like(data)
            lease.read_into(out)
            assert np.array_equal(out, data)
            assert lease.read_into_hashed(out) == xxhash.xxh3_64_intdigest(data.data)
            assert (await kv.stats()).extra["active_leases"] == base + 1
        assert lease.released
        assert (await kv.stats()).extra["active_leases"] == base
        assert await lease.release() is True, "releasing twice is a no-op"
        with pytest.raises(InvalidArgument, match="released"):
            lease.read()
        assert await kv.acquire(b"\x09" * 32) is None

    drive(body, "shm")


@pytest.mark.parametrize("verify", [True, False], ids=["client-verifies", "server-verifies"])
def test_a_payload_changed_in_the_arena_is_never_served(drive: Drive, verify: bool) -> None:
    """A rogue writer on the host flips a byte of a committed chunk: whichever side checks,
    the reader gets a miss or a good copy from a lower tier, and the L1 copy is dropped."""
    data = payload(256 * 4096, seed=77)

    async def body(kv: Any) -> None:
        corrupt = (await kv.stats()).tiers[0].corrupt
        ns = namespace(f"contract-rogue-{drive.kind}-{verify}", 4096)
        key, status = await kv.put_chunk(ns, ROOT, tokens(256), data, "bfloat16", (256, 2048))
        assert status == PutStatus.STORED
        lease = await kv.acquire(key)
        assert lease is not None
        extents, start = lease._extents, lease._offset
        await lease.release()
        at = 12345
        with ArenaView.open((await kv.info()).shm_path) as rogue:
            rogue.write(extents, start + at, b"\x5a" if data[at] != 0x5A else b"\xa5")
        out = np.zeros(data.size, dtype=np.uint8)
        got = await kv.get_into(key, out)
        assert got is None or np.array_equal(out, data), "changed bytes were served"
        assert (await kv.stats()).tiers[0].corrupt == corrupt + 1, "the bad L1 copy is counted"

    drive(body, "shm", verify=verify)


# -- reading a batch: acquire_many, copy out verified, release_many ------------------------


def _requests(stats: Any) -> dict[str, int]:
    """The server's finished calls by method (StatsResponse.requests)."""
    return dict(stats.extra["requests"])


def _delta(after: dict[str, int], before: dict[str, int], *methods: str) -> dict[str, int]:
    return {m: after.get(m, 0) - before.get(m, 0) for m in methods}


async def _put_batch(kv: Any, ns: Namespace, n: int, bpt: int, seed: int) -> list[Any]:
    """``n`` chained chunks of 64 tokens (``_chain``) stored with one ReserveMany +
    CommitMany; their (key, payload) pairs, in order."""
    headers, datas = _chain(ns, n, bpt, seed)
    reservations = await kv.reserve(headers)
    for res, data in zip(reservations, datas, strict=True):
        res.write(data)
    assert await kv.commit(reservations) == [PutStatus.STORED] * n
    return [(h.key, d) for h, d in zip(headers, datas, strict=True)]


def test_acquire_many_costs_one_call_for_64_chunks(drive: Drive) -> None:
    """64 chunks: one AcquireMany and one Release in the server's request counts, no
    Acquire; each lease copies its payload out verified in one pass, into one buffer
    or scattered over the blocks of one; a miss is None, in its place."""
    bpt = 1024
    ns = namespace(f"contract-many-{drive.kind}", bpt)

    async def body(kv: Any) -> None:
        chunks = await _put_batch(kv, ns, 64, bpt, seed=70_000)
        keys = [k for k, _ in chunks]
        missing = b"\x0c" * 32
        before = await kv.stats()
        got = await kv.acquire_many([*keys[:32], missing, *keys[32:]])
        assert len(got) == 65 and got[32] is None, "the miss is None, in its place"
        leases = got[:32] + got[33:]
        assert [lease.header.key for lease in leases] == keys, "leases out of order"
        mid = await kv.stats()
        # >=: holds of earlier tests on the shared server may still be ending.
        assert mid.extra["active_leases"] >= before.extra["active_leases"] + 64

        size = 64 * bpt
        out = np.zeros(size, dtype=np.uint8)
        blocks = np.zeros(8 * size, dtype=np.uint8)  # a "paged cache": 16 blocks of 4 KiB
        for i, (lease, (_, data)) in enumerate(zip(leases, chunks, strict=True)):
            assert lease.read_verified(out) is True, f"chunk {i}: a good copy fails to verify"
            assert np.array_equal(out, data), f"chunk {i}: read_verified copied other bytes"
            if i % 16 == 0:  # the chunk's 16 pieces land in blocks 15, 13, 11, ... reversed
                pieces = [((31 - 2 * j) * 4096, 4096) for j in range(16)]
                assert lease.read_scattered(blocks, pieces) is True, f"chunk {i}"
                for j, (at, n) in enumerate(pieces):
                    part = data[j * 4096 : (j + 1) * 4096]
                    assert np.array_equal(blocks[at : at + n], part), f"chunk {i} piece {j}"

        # The same payloads in 4 parts each (a KV cache loaded layer by layer), every
        # lease's part k in one copy: each lands where its pieces say and verifies.
        batch = ScatterBatch(blocks := np.zeros(64 * size, dtype=np.uint8))
        quarter = size // 4
        for i, lease in enumerate(leases):
            parts = [[((63 - i) * size + (3 - q) * quarter, quarter)] for q in range(4)]
            assert batch.add(lease, parts) == i
        with pytest.raises(InvalidArgument, match="out of order"):
            batch.copy(1)
        for q in range(4):
            batch.copy(q)
        assert batch.verified() == [True] * 64, "a good copy in parts fails to verify"
        for i, (_, data) in enumerate(chunks):
            at = (63 - i) * size
            for q in range(4):
                got = blocks[at + (3 - q) * quarter : at + (4 - q) * quarter]
                assert np.array_equal(got, data[q * quarter : (q + 1) * quarter]), (i, q)

        assert await kv.release_many(leases) == 64, "every lease was still held"
        assert all(lease.released for lease in leases)
        assert await kv.release_many(leases) == 0, "released leases are skipped"
        after = await kv.stats()
        assert after.extra["active_leases"] <= mid.extra["active_leases"] - 64
        counts = _delta(_requests(after), _requests(before), "AcquireMany", "Acquire", "Release")
        assert counts == {"AcquireMany": 1, "Acquire": 0, "Release": 1}, (
            f"64 chunks must cost exactly one AcquireMany and one Release: {counts}"
        )
        assert await kv.clear(ns) == 64  # the shared server's arena is for the next tests

    drive(body, "shm")


def test_acquire_many_batches_and_release_later(drive: Drive) -> None:
    """Past 1024 keys the client splits the call (one AcquireMany per 1024); a release
    not waited for still ends every lease."""
    bpt = 512
    ns = namespace(f"contract-many-later-{drive.kind}", bpt)

    async def body(kv: Any) -> None:
        chunks = await _put_batch(kv, ns, 4, bpt, seed=80_000)
        keys = [k for k, _ in chunks]
        base = (await kv.stats()).extra["active_leases"]
        before = _requests(await kv.stats())
        misses = [i.to_bytes(4, "little") * 8 for i in range(1, 1100)]
        got = await kv.acquire_many([*misses, *keys])
        counts = _delta(_requests(await kv.stats()), before, "AcquireMany")
        assert counts == {"AcquireMany": 2}, f"1103 keys are two calls: {counts}"
        assert got[: len(misses)] == [None] * len(misses)
        leases = got[len(misses) :]
        assert all(isinstance(_unwrap(x), LeaseBase) for x in leases), leases
        assert (await kv.stats()).extra["active_leases"] >= base + 4
        assert await kv.release_later(leases) is None
        assert all(lease.released for lease in leases)
        deadline = time.monotonic() + 10
        while (await kv.stats()).extra["active_leases"] > base:
            assert time.monotonic() < deadline, "release_later did not end the leases"
            await asyncio.sleep(0.02)
        with pytest.raises(InvalidArgument, match="released"):
            leases[0].read_verified(np.zeros(4 * bpt * 64, np.uint8))
        assert await kv.clear(ns) == 4

    drive(body, "shm")


def test_acquire_many_lends_l2_chunks_in_place(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """``disk=True``, on a restarted server (every chunk in L2 only): each chunk comes as
    a lease over L2's LMDB file, mapped read-only here, and verifies as it is copied out
    (into one buffer, or scattered); none is promoted into L1; one AcquireMany and one
    Release. Without ``disk`` they are promoted (L1 holds them after). Loans a client
    leaves open end with its session."""
    bpt = 1024
    ns = namespace(f"contract-loans-{drive.kind}", bpt)
    srv = make_server(f"loans-{drive.kind}").start()

    async def put(kv: Any) -> list[Any]:
        return await _put_batch(kv, ns, 8, bpt, seed=75_000)

    chunks = drive(put, server=srv)
    keys = [k for k, _ in chunks]
    srv.stop()
    srv.start()

    async def body(kv: Any) -> None:
        info = await kv.info()
        assert info.disk_path.endswith("data.mdb") and info.disk_map_size > 0, info
        assert await kv.acquire_many([b"\x0d" * 32]) == [None]  # the arena is mapped now
        assert kv._disk is None, "L2's file is mapped only by a call that asks for loans"
        before = await kv.stats()
        got = _unwrap(await kv.acquire_many(keys, disk=True))
        assert kv._disk is not None
        assert all(isinstance(x, LeaseBase) for x in got), got
        out = np.zeros(64 * bpt, dtype=np.uint8)
        blocks = np.zeros(8 * 64 * bpt, dtype=np.uint8)
        pieces = [((31 - 2 * j) * 4096, 4096) for j in range(16)]
        for i, (lease, (_, data)) in enumerate(zip(got, chunks, strict=True)):
            assert lease.read_verified(out) and np.array_equal(out, data), f"chunk {i}"
            assert lease.read_scattered(blocks, pieces), f"chunk {i} scattered"
        mid = await kv.stats()
        assert mid.tiers[1].detail["loans"] == 8, mid.tiers[1].detail
        assert mid.tiers[0].used_bytes == before.tiers[0].used_bytes, "a loan promoted into L1"
        # In parts beside leases from L1 (two mappings in one batch): each verifies.
        plain = await kv.acquire_many(keys[:2])
        batch = ScatterBatch(blocks := np.zeros(10 * 64 * bpt, dtype=np.uint8))
        half = 32 * bpt
        for i, lease in enumerate([*got, *plain]):
            batch.add(lease, [[(i * 64 * bpt + half, half)], [(i * 64 * bpt, half)]])
        batch.copy(0)
        batch.copy(1)
        assert batch.verified() == [True] * 10
        for i, (_, data) in enumerate([*chunks, *chunks[:2]]):
            at = i * 64 * bpt
            assert np.array_equal(blocks[at + half : at + 2 * half], data[:half]), i
            assert np.array_equal(blocks[at : at + half], data[half:]), i
        await kv.release_many(plain)
        assert await kv.release_many(got) == 8, "every loan was still held"
        after = await kv.stats()
        assert after.tiers[1].detail["loans"] == 0
        counts = _delta(_requests(after), _requests(before), "AcquireMany", "Release")
        assert counts == {"AcquireMany": 2, "Release": 2}, f"the loans' and L1's: {counts}"
        plain = await kv.acquire_many(keys[:2])
        assert all(1 in w for w in await kv.exists(keys[:2])), "without disk: promoted"
        await kv.release_many(plain)
        await kv.acquire_many(keys[2:], disk=True)  # left to the session's end

    drive(body, server=srv)

    async def gone(kv: Any) -> None:
        deadline = time.monotonic() + 10
        while (await kv.stats()).tiers[1].detail["loans"]:
            assert time.monotonic() < deadline, "a closed client's loans outlived its session"
            await asyncio.sleep(0.02)

    drive(gone, server=srv)


def test_a_release_of_many_ends_those_still_held(drive: Drive) -> None:
    """One Release naming a lease the server no longer knows (expired, another session's)
    ends the others all the same, and says how many; only a Release of none it knows is
    NotFound. (It used to fail whole, leaving every other lease held until it expired.)"""
    bpt = 512
    ns = namespace(f"contract-many-release-{drive.kind}", bpt)

    async def body(kv: Any) -> None:
        chunks = await _put_batch(kv, ns, 3, bpt, seed=85_000)
        base = (await kv.stats()).extra["active_leases"]
        leases = await kv.acquire_many([k for k, _ in chunks])
        ids = [lease.id for lease in leases]
        r = await kv._run(core.rpc("Release", pb.ReleaseRequest(lease_ids=[*ids, 987654321]), None))
        assert r.released == 3, r
        assert (await kv.stats()).extra["active_leases"] <= base, "a lease stayed held"
        for lease in leases:
            lease.released = True  # ended by the raw Release above
        assert await kv.clear(ns) == 3

    drive(body, "shm")


def test_acquire_many_says_which_chunks_to_stream(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """A chunk stored only below L1 that L1 cannot lend (larger than the arena) is
    ``USE_GET``, told apart from a miss (None); get_into streams it."""
    srv = make_server("many-big", memory="4MiB").start()
    ns = namespace(f"contract-many-big-{drive.kind}", 24 * 1024)
    data = payload(256 * 24 * 1024, 78)  # 6 MiB > the 4 MiB arena

    async def body(kv: Any) -> None:
        big, status = await kv.put_chunk(
            ns, ROOT, tokens(256, 6000), data, "bfloat16", (256, 12 * 1024)
        )
        assert status == PutStatus.STORED and await kv.exists([big]) == [(2,)]
        small, _ = await kv.put_chunk(
            ns, big, tokens(16, 7000), payload(16 * 24 * 1024, 3), "bfloat16", (16, 12 * 1024)
        )
        got = await kv.acquire_many([big, b"\x0d" * 32, small])
        assert got[0] is kvstore.sdk.client.USE_GET, f"a chunk L1 cannot lend: {got[0]!r}"
        assert got[1] is None, "a miss"
        assert isinstance(_unwrap(got[2]), LeaseBase) and got[2].header.key == small
        assert await kv.release_many([got[2]]) == 1
        out = np.empty_like(data)
        assert await kv.get_into(big, out) is not None and np.array_equal(out, data)

    drive(body, "shm", server=srv)
    assert srv.stop() == 0, srv.log()


def test_lookup_with_prefetch_brings_disk_chunks_into_l1(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """After a restart every chunk is on disk only: a lookup with prefetch answers at once
    (by_tier says disk) and the chunks reach L1 in the background, where one
    AcquireMany lends them all."""
    srv = make_server("prefetch").start()
    bpt, n = 256, 8
    ns = namespace(f"contract-prefetch-{drive.kind}", bpt)
    prompt = tokens(n * 256, 95_000)

    async def store(kv: Any) -> list[Any]:
        ct = (await kv.info()).chunk_tokens
        assert ct == 256, ct
        parent, out = ROOT, []
        for i in range(n):
            data = payload(ct * bpt, i)
            part = prompt[i * ct : (i + 1) * ct]
            parent, status = await kv.put_chunk(ns, parent, part, data, "bfloat16", (ct, bpt // 2))
            assert status == PutStatus.STORED
            out.append((parent, data))
        return out

    chunks = drive(store, "shm", server=srv)
    assert srv.stop() == 0, srv.log()
    srv = make_server("prefetch", data_dir=srv.data_dir).start()
    keys = [k for k, _ in chunks]

    async def body(kv: Any) -> None:
        assert await kv.exists(keys) == [(2,)] * n, "a restarted server holds them in L2"
        r = await kv.lookup(ns, prompt, prefetch=True)
        assert r.matched_tokens == n * 256 and r.by_tier == {2: n * 256}, r
        deadline = time.monotonic() + 10
        while any(1 not in t for t in await kv.exists(keys)):
            assert time.monotonic() < deadline, "prefetched chunks did not reach L1 in 10 s"
            await asyncio.sleep(0.02)
        again = await kv.lookup(ns, prompt)
        assert again.by_tier == {1: n * 256}, again.by_tier
        leases = await kv.acquire_many(keys)
        out = np.empty(256 * bpt, dtype=np.uint8)
        for lease, (_, data) in zip(leases, chunks, strict=True):
            assert lease.read_verified(out) and np.array_equal(out, data)
        assert await kv.release_many(leases) == n
        detail = memory_detail_of(await kv.stats())
        assert detail["prefetch_done"] == n and detail["prefetch_failed"] == 0, detail

    drive(body, "shm", server=srv)
    assert srv.stop() == 0, srv.log()


def test_acquire_many_copies_changed_bytes_as_unverified(drive: Drive) -> None:
    """A byte changed in the arena under a lease: read_verified and read_scattered say
    False (the caller then reads the chunk with get_into); a bad key fails the whole
    call and leaves no lease behind."""
    bpt = 1024
    ns = namespace(f"contract-many-rogue-{drive.kind}", bpt)

    async def body(kv: Any) -> None:
        ((key, data),) = await _put_batch(kv, ns, 1, bpt, seed=90_000)
        base = (await kv.stats()).extra["active_leases"]
        with pytest.raises(InvalidArgument, match="chunk keys are 32"):
            await kv.acquire_many([key, b"short"])
        assert (await kv.stats()).extra["active_leases"] <= base, "a lease outlived the error"
        (lease,) = await kv.acquire_many([key])
        at = 777
        with ArenaView.open((await kv.info()).shm_path) as rogue:
            rogue.write(lease._extents, lease._offset + at, bytes([data[at] ^ 0xFF]))
        out = np.zeros(data.size, dtype=np.uint8)
        assert lease.read_verified(out) is False, "changed bytes verified"
        assert lease.read_scattered(out, [(0, data.size)]) is False
        batch = ScatterBatch(out)
        batch.add(lease, [[(0, at)], [(at, data.size - at)]])
        with pytest.raises(InvalidArgument, match="cover"):
            ScatterBatch(out).add(lease, [[(0, at)], [(at, 10)]])
        batch.copy(0)
        batch.copy(1)
        assert batch.verified() == [False], "changed bytes verified in parts"
        with pytest.raises(InvalidArgument, match="cover"):
            lease.read_scattered(out, [(0, 10)])
        with pytest.raises(InvalidArgument, match="outside"):
            lease.read_scattered(out, [(data.size, data.size)])
        assert await kv.release_many([lease]) == 1
        again = np.zeros(data.size, dtype=np.uint8)
        got = await kv.get_into(key, again)
        assert got is None or np.array_equal(again, data), "changed bytes were served"
        await kv.clear(ns)

    drive(body, "shm")


# -- tenants --------------------------------------------------------------------------------

ADMIN, ALPHA, BETA = "admin-contract", "alpha-contract", "beta-contract"


@pytest.fixture
def tenants_server(make_server: Callable[..., KVServer], tmp_path: Path) -> Iterator[KVServer]:
    (tmp_path / "tenants").write_text(f"alpha:{ALPHA}\nbeta:{BETA}\n")
    srv = make_server(
        "tenants", args=["--token", ADMIN, "--tenant-tokens", str(tmp_path / "tenants")]
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("plane", PLANES)
def test_put_chunk_proves_a_tenants_namespace_and_retries(
    drive: Drive, plane: str, tenants_server: KVServer
) -> None:
    ns = Namespace(model="contract-tenants", dtype="bfloat16", layout="t", salt="alpha")
    data = payload(16 * 64, 7)
    header = chunk_header(ns, ROOT, tokens(16, 5), data, "bfloat16", (16, 32))

    async def body(kv: Any) -> None:
        with pytest.raises(NamespaceNotRegistered):
            await kv.put(header, data)
        with pytest.raises(NamespaceNotRegistered):  # a fingerprint alone proves nothing
            await kv.put_chunk(ns.fingerprint, ROOT, tokens(16, 5), data, "bfloat16", (16, 32))
        unsalted = Namespace(model="contract-tenants", dtype="bfloat16", layout="t")
        with pytest.raises(PermissionDenied):
            await kv.lookup(unsalted, tokens(16, 1))
        key, status = await kv.put_chunk(ns, ROOT, tokens(16, 5), data, "bfloat16", (16, 32))
        assert status is PutStatus.STORED and key == header.key, status
        got = await kv.get(key)
        assert got is not None and got[1] == data.tobytes()

    # A server with tenants offers no shared memory: the Unix socket streams too.
    drive(body, plane, server=tenants_server, token=ALPHA, shm=None)

    async def stranger(kv: Any) -> None:  # beta cannot prove alpha's namespace
        with pytest.raises(PermissionDenied):
            await kv.put_chunk(ns, ROOT, tokens(16, 6), data, "bfloat16", (16, 32))

    drive(stranger, plane, server=tenants_server, token=BETA, shm=None)


def test_tenants_look_up_by_token_ids(drive: Drive, tenants_server: KVServer) -> None:
    """A tenant's Info offers no lookup by keys and its client sends token ids (keys a
    client hashed could name another tenant's chunks, in L3 above all); a tenant's
    Lookup by chunk_keys is refused. The admin's lookups go by keys."""
    ns = Namespace(model="contract-tenants-keys", dtype="bfloat16", layout="t", salt="alpha")
    prompt = tokens(256, 300)

    async def alpha(kv: Any) -> None:
        assert (await kv.info()).lookup_by_keys is False
        await kv.put_chunk(ns, ROOT, prompt, payload(256 * 64, 1), "bfloat16", (256, 32))
        seen: list[tuple[str, Any]] = []
        _spy(kv, seen)
        assert (await kv.lookup(ns, prompt)).matched_tokens == 256
        del _client(kv)._step
        (req,) = [r for m, r in seen if m == "Lookup"]
        assert req.token_ids and not req.chunk_keys, "a tenant's client sends token ids"
        keyed = pb.LookupRequest(
            fingerprint=ns.fingerprint,
            chunk_keys=chunk_header(ns, ROOT, prompt, None, "bfloat16", (256, 32)).key,
            n_tokens=256,
            namespace=req.namespace,
        )
        with pytest.raises(PermissionDenied, match="tenants look up by token_ids"):
            await kv._run(core.rpc("Lookup", keyed, None))

    drive(alpha, "grpc", server=tenants_server, token=ALPHA, shm=None)

    async def admin(kv: Any) -> None:
        assert (await kv.info()).lookup_by_keys is True
        seen: list[tuple[str, Any]] = []
        _spy(kv, seen)
        assert (await kv.lookup(ns, prompt)).matched_tokens == 256
        (req,) = [r for m, r in seen if m == "Lookup"]
        assert req.chunk_keys and not req.token_ids, "the admin's client sends keys"

    drive(admin, "grpc", server=tenants_server, token=ADMIN, shm=None)


# -- drops (a consumer's one-shot load: the seed's drop_select) --------------------------------


def _dropped(stats: Any) -> tuple[int, int]:
    return stats.dropped, stats.drops_deferred


async def _gone(kv: Any, keys: list[bytes], what: str) -> None:
    """Until no tier holds ``keys`` (a drop that waited for a Session to end lands a
    moment after the client closed)."""
    deadline = time.monotonic() + 10
    while (found := await kv.exists(keys)) != [()] * len(keys):
        assert time.monotonic() < deadline, f"{what}: still stored: {found}"
        await asyncio.sleep(0.02)


@pytest.mark.skipif(not available("redis"), reason="redis-server is not installed")
@pytest.mark.parametrize("plane", PLANES)
def test_a_drop_deletes_loaded_chunks_from_every_tier_in_one_release(
    drive: Drive, plane: str, make_server: Callable[..., KVServer]
) -> None:
    """Chunks written through to L2 and L3, loaded (leases on shm, Get over gRPC) and
    dropped: one Release for all of them (no Delete), each gone from L1, LMDB and Redis,
    the lookup finds nothing, Stats counts them; a key not stored is skipped."""
    bpt = 512
    ns = namespace(f"contract-drop-{drive.kind}-{plane}", bpt)
    with RedisServer("redis") as redis:
        srv = make_server("drops", args=["--remote", redis.url, "--chunk-tokens", "64"]).start()

        async def body(kv: Any) -> None:
            chunks = await _put_batch(kv, ns, 3, bpt, seed=90_000) if plane == "shm" else []
            if plane == "grpc":
                parent = ROOT
                for i in range(3):
                    data = payload(64 * bpt, 90_000 + i)
                    parent, st = await kv.put_chunk(
                        ns, parent, tokens(64, 90_000 + 64 * i), data, "bfloat16", (64, bpt // 2)
                    )
                    assert st == PutStatus.STORED, st
                    chunks.append((parent, data))
            keys = [k for k, _ in chunks]
            prompt = tokens(192, 90_000)
            deadline = time.monotonic() + 20
            while (where := await kv.exists(keys)) != [(1, 2, 3)] * 3:  # written through
                assert time.monotonic() < deadline, f"not written down to L2 and L3: {where}"
                await asyncio.sleep(0.05)
            assert (await kv.lookup(ns, prompt)).matched_tokens == 192
            in_redis = [k for k in redis.cli("KEYS", "*").split() if ":c:" in k]
            assert len(in_redis) == 3, f"Redis's chunk records: {in_redis}"
            before = await kv.stats()
            if plane == "shm":
                leases = await kv.acquire_many(keys)
                for lease, (_, data) in zip(leases, chunks, strict=True):
                    out = np.empty_like(data)
                    assert lease.read_verified(out) and np.array_equal(out, data)
            else:
                leases = []
                for key, data in chunks:
                    got = await kv.get(key)
                    assert got is not None and got[1] == data.tobytes()
            r = await kv.drop([*keys, b"\x0d" * 32], release=leases)
            if plane == "shm":
                assert r == core.Dropped(3, 3, 0), f"{plane}: {r}"
            else:  # a Get's own lease may end a moment after its last piece arrived
                assert r.released == 0 and r.dropped + r.deferred == 3, r
                await _gone(kv, keys, "dropped after the Get streams ended")
            assert all(lease.released for lease in leases)
            after = await kv.stats()
            assert await kv.exists(keys) == [()] * 3, "a dropped chunk is still in some tier"
            left = [k for k in redis.cli("KEYS", "*").split() if ":c:" in k]
            assert left == [], f"Redis still holds dropped chunks: {left}"
            assert (await kv.lookup(ns, prompt)).matched_tokens == 0
            assert await kv.get(keys[0]) is None
            counts = _delta(_requests(after), _requests(before), "Release", "Delete")
            assert counts == {"Release": 1, "Delete": 0}, f"drops must cost one Release: {counts}"
            assert _dropped(after) == (3, 0), _dropped(after)
            assert after.extra["active_leases"] == 0, "a lease of the drop stayed held"

        drive(body, plane, server=srv)
        assert srv.stop() == 0, srv.log()


def test_a_chunk_another_client_holds_is_dropped_when_its_last_lease_ends(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """Both sides of a drop: the dropper's chunk that nobody else holds goes at once; the
    ones another client leased before the drop stay stored and readable for it (its
    bytes verify, the chunk can even be leased again meanwhile) and go from every tier
    when its last lease ends: released, or dropped with its Session when it closes."""
    bpt = 512
    ns = namespace(f"contract-drop-held-{drive.kind}", bpt)
    srv = make_server("drops-held").start()

    async def body(kv: Any) -> None:
        chunks = await _put_batch(kv, ns, 3, bpt, seed=95_000)
        keys = [k for k, _ in chunks]
        deadline = time.monotonic() + 20
        while (where := await kv.exists(keys)) != [(1, 2)] * 3:  # the write-down is done
            assert time.monotonic() < deadline, f"not written down to L2: {where}"
            await asyncio.sleep(0.05)
        with kvstore.Client(srv.unix_url, shm=True, timeout=30) as holder:
            held = holder.acquire_many(keys[1:])  # another engine's load, under way
            mine = await kv.acquire_many(keys)
            r = await kv.drop(keys, release=mine)
            assert r == core.Dropped(3, 1, 2), f"one free, two held by the other client: {r}"
            assert await kv.exists(keys) == [(), (1, 2), (1, 2)], "held chunks must stay"
            for lease, (_, data) in zip(held, chunks[1:], strict=True):
                out = np.empty_like(data)
                assert lease.read_verified(out), "a held chunk's bytes changed under its lease"
                assert np.array_equal(out, data), "a held chunk reads other bytes after a drop"
            again = holder.acquire(keys[1])  # still stored: it can be leased again
            assert again is not None, "a chunk whose drop waits is still stored"
            assert holder.release_many([held[0]]) == 1
            assert await kv.exists(keys[1:2]) == [(1, 2)], "the second lease still holds it"
            again.release()
            await _gone(kv, keys[1:2], "released by its last holder")
            assert await kv.exists(keys[2:]) == [(1, 2)], "the other held chunk went too early"
            assert _dropped(await kv.stats()) == (2, 2)
        await _gone(kv, keys[2:], "its holder closed (the Session's leases dropped)")
        stats = await kv.stats()
        assert _dropped(stats) == (3, 2), _dropped(stats)
        assert stats.chunks == 0 and stats.extra["active_leases"] == 0, stats

    drive(body, "shm", server=srv)
    assert srv.stop() == 0, srv.log()


def test_a_tenant_drops_only_chunks_of_its_own_namespaces(
    drive: Drive, tenants_server: KVServer
) -> None:
    """A tenant's drop (streamed: tenants have no leases) of another tenant's chunk is a
    miss, as its Delete is: the chunk stays and its owner still reads it; the owner's
    own drop deletes it."""
    ns = Namespace(model="contract-drop-tenants", dtype="bfloat16", layout="t", salt="alpha")
    data = payload(16 * 64, 12)

    async def alpha_puts(kv: Any) -> bytes:
        key, status = await kv.put_chunk(ns, ROOT, tokens(16, 9), data, "bfloat16", (16, 32))
        assert status is PutStatus.STORED, status
        return bytes(key)

    key = drive(alpha_puts, "grpc", server=tenants_server, token=ALPHA, shm=None)

    async def beta_drops(kv: Any) -> None:
        assert await kv.drop([key]) == core.Dropped(0, 0, 0), "beta dropped alpha's chunk"

    drive(beta_drops, "grpc", server=tenants_server, token=BETA, shm=None)

    async def alpha_drops(kv: Any) -> None:
        got = await kv.get(key)
        assert got is not None and got[1] == data.tobytes(), "alpha's chunk went"
        assert await kv.drop([key]) == core.Dropped(0, 1, 0)
        assert await kv.get(key) is None

    drive(alpha_drops, "grpc", server=tenants_server, token=ALPHA, shm=None)


def test_a_bad_drop_is_refused_whole(drive: Drive) -> None:
    """A Release whose drop_keys hold a key that is no key, or more than 1024 of them, is
    INVALID_ARGUMENT and ends none of its leases (checked before anything is released);
    the SDK refuses more than 1024 before sending."""
    bpt = 512
    ns = namespace(f"contract-drop-bad-{drive.kind}", bpt)

    async def body(kv: Any) -> None:
        ((key, _),) = await _put_batch(kv, ns, 1, bpt, seed=97_000)
        (lease,) = await kv.acquire_many([key])
        bad = pb.ReleaseRequest(lease_ids=[lease.id], drop_keys=[b"short"])
        with pytest.raises(InvalidArgument, match="key #0 is 5 bytes"):
            await kv._run(core.rpc("Release", bad, None))
        many = pb.ReleaseRequest(lease_ids=[lease.id], drop_keys=[key] * 1025)
        with pytest.raises(InvalidArgument, match="1025 drop_keys in one Release; at most 1024"):
            await kv._run(core.rpc("Release", many, None))
        with pytest.raises(InvalidArgument, match="at most 1024"):
            await kv.drop([bytes([i % 256, i // 256]) * 16 for i in range(1025)])
        assert await kv.drop([key], release=[lease]) == core.Dropped(1, 1, 0), (
            "the refused Releases must have left the lease held and the chunk stored"
        )

    drive(body, "shm")


# -- errors ---------------------------------------------------------------------------------


def test_errors_of_bad_arguments(drive: Drive) -> None:
    ns = namespace(f"contract-args-{drive.kind}", 64)
    data = payload(16 * 64, 1)
    header = chunk_header(ns, ROOT, tokens(16), data, "bfloat16", (16, 32))

    async def body(kv: Any) -> None:
        with pytest.raises(InvalidArgument, match="namespace or all"):
            await kv.clear()
        with pytest.raises(InvalidArgument, match="namespace or all"):
            await kv.clear(ns, all=True)
        with pytest.raises(InvalidArgument, match="fingerprint"):
            await kv.lookup("not a namespace", tokens(16))
        with pytest.raises(InvalidArgument, match="payload is"):
            await kv.put(header, data[:-1])
        with pytest.raises(InvalidArgument, match="payload is"):
            await kv.put_chunk(ns, ROOT, tokens(16), data[:-2], "bfloat16", (16, 32))
        with pytest.raises(InvalidArgument):  # the server refuses a key that is no key
            await kv.exists([b"short"])

    drive(body, "shm")


def test_errors_of_unknown_leases_and_reservations(drive: Drive) -> None:
    """A lease or reservation the server does not know (expired, another session's,
    used already) is NotFound on the wire; a Release of one answers False."""

    async def body(kv: Any) -> None:
        assert kv.shm_active
        assert await kv._run(core.release(987654321, None)) is False
        with pytest.raises(NotFound, match="unknown lease"):
            await kv._run(core.rpc("Release", pb.ReleaseRequest(lease_ids=[987654321]), None))
        with pytest.raises(NotFound, match="unknown reservation"):
            await kv._run(writes.finish(987654321, True, 0, None))
        assert await kv._run(writes.finish(987654321, False, None, None)) == PutStatus.EXISTS

    drive(body, "shm")


# -- lifecycle ------------------------------------------------------------------------------


@pytest.mark.parametrize("plane", PLANES)
def test_close(drive: Drive, plane: str) -> None:
    """Closing ends the Session (the server drops the client's leases); every call
    afterwards raises, and closing again does nothing."""
    ns = namespace(f"contract-close-{drive.kind}-{plane}", 64)

    async def body(kv: Any) -> Any:
        key, _ = await kv.put_chunk(ns, ROOT, tokens(16), payload(1024, 2), "bfloat16", (16, 32))
        if plane == "shm":
            assert await kv.acquire(key) is not None  # held until the client goes
        return kv, key

    with kvstore.Client(drive.server.unix_url) as watcher:
        base = memory_detail(watcher)["active_leases"]
        kv, key = drive(body, plane)  # closed at the end of the drive
        deadline = time.monotonic() + 5
        while memory_detail(watcher)["active_leases"] != base and time.monotonic() < deadline:
            time.sleep(0.05)  # the server drops them when it sees the Session end
        assert memory_detail(watcher)["active_leases"] == base, "the closed client's lease stayed"

    async def after(kv: Any) -> None:
        for call in (
            lambda: kv.info(),
            lambda: kv.health(),
            lambda: kv.get(key),
            lambda: kv.put_chunk(ns, ROOT, tokens(16), payload(1024, 2), "bfloat16", (16, 32)),
            lambda: kv.lookup(ns, tokens(16)),
        ):
            with pytest.raises(KVStoreError, match="closed"):
                await call()
        await kv.close()  # again: nothing happens

    asyncio.run(after(kv))


def test_a_client_lives_through_a_server_restart(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """The Session ends with the server; the next call finds the new server's arena."""
    srv = make_server("restart").start()
    ns = namespace(f"contract-restart-{drive.kind}", 64)

    async def body(kv: Any) -> None:
        nonlocal srv
        key, _ = await kv.put_chunk(ns, ROOT, tokens(16), payload(1024, 4), "bfloat16", (16, 32))
        old = (await kv.info()).shm_path
        assert kv.shm_active
        old_view = _client(kv)._arena
        assert old_view is not None
        assert srv.stop() == 0, srv.log()
        srv = make_server("restart", data_dir=srv.data_dir).start()  # same socket path
        for _ in range(100):  # until the client has seen its Session end
            if not _client(kv)._session_alive():
                break
            await asyncio.sleep(0.05)
        again, status = await kv.put_chunk(
            ns, key, tokens(16, 16), payload(1024, 5), "bfloat16", (16, 32)
        )
        assert status.ok and kv.shm_active, status
        assert (await kv.info()).shm_path != old, "the client still maps the old arena"
        for _ in range(100):  # unmapped on a thread of its own, off the call's path
            if old_view.closed:
                break
            await asyncio.sleep(0.05)
        assert old_view.closed, "the old server's arena is still mapped (its pages held)"
        got = await kv.get(again)
        assert got is not None and got[1] == payload(1024, 5).tobytes()
        assert await kv.get(key) is not None, "the chunk written before the restart is in L2"

    drive(body, "shm", server=srv)
    assert srv.stop() == 0, srv.log()
