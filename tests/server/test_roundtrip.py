"""Round trips through a real kvstore-server over both data planes, and the management RPCs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvstore
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import ROOT
from kvstore.testing.server import KVServer
from kvstore.types import PutStatus
from tests.server.helpers import memory_detail, namespace, payload, put_chain, shape_for, tokens

MiB = 1 << 20


@pytest.fixture(params=[True, False], ids=["shm", "grpc"])
def client(request: pytest.FixtureRequest, server: KVServer) -> Iterator[kvstore.Client]:
    shm = request.param
    # shm over the Unix socket, streaming over TCP: the two ways clients really connect.
    c = kvstore.Client(server.unix_url if shm else server.tcp_url, shm=shm, timeout=30)
    yield c
    c.close()


@pytest.mark.parametrize("nbytes", [512, MiB + 4096, 32 * MiB], ids=["512B", "1MiB+", "32MiB"])
def test_put_get_byte_exact(client: kvstore.Client, nbytes: int) -> None:
    plane = "shm" if client._shm_pref else "grpc"
    n_tok = 256
    bpt = nbytes // n_tok
    ns = namespace(f"rt-{plane}", bpt)
    data = payload(n_tok * bpt, seed=nbytes)
    key, status = client.put_chunk(ns, ROOT, tokens(n_tok), data, "bfloat16", shape_for(n_tok, bpt))
    assert status == PutStatus.STORED, f"{plane}: put returned {status}"
    assert client.shm_active is (plane == "shm"), f"data plane is not {plane}"

    got = client.get(key)
    assert got is not None, f"{plane}: stored chunk not found"
    header, blob = got
    assert header.key == key and header.shape == shape_for(n_tok, bpt)
    assert blob == data.tobytes(), f"{plane}: get returned different bytes"

    out = np.zeros(data.size + 7, dtype=np.uint8)  # larger buffers are fine
    h2 = client.get_into(key, out)
    assert h2 is not None and h2.key == key
    assert np.array_equal(out[: data.size], data), f"{plane}: get_into wrote different bytes"

    again = client.put_chunk(ns, ROOT, tokens(n_tok), data, "bfloat16", shape_for(n_tok, bpt))
    assert again == (key, PutStatus.EXISTS), f"second put of the same chunk: {again}"


def test_miss_and_small_buffer(client: kvstore.Client) -> None:
    assert client.get(b"\x01" * 32) is None, "unknown key must be a miss"
    assert client.get_into(b"\x02" * 32, bytearray(16)) is None
    ns = namespace("small-buf", 64)
    key, _ = client.put_chunk(ns, ROOT, tokens(16), payload(1024, 3), "bfloat16", (16, 32))
    with pytest.raises(InvalidArgument, match="output buffer"):
        client.get_into(key, bytearray(100))
    with pytest.raises(InvalidArgument, match="read-only"):
        client.get_into(key, b"\0" * 2048)


def test_lookup_through_server(server: KVServer) -> None:
    with kvstore.Client(server.unix_url) as c:
        info = c.info()
        ct = info.chunk_tokens
        ns = namespace("lookup", 64)
        prompt = tokens(4 * ct, start=10_000)
        put_chain(c, ns, prompt, ct, 64)

        full = c.lookup(ns, prompt)
        assert full.matched_tokens == 4 * ct and full.stop == "complete", full
        assert len(full.chunks) == 4 and full.by_tier.get(1) == 4 * ct, full

        # Diverges 40 tokens into the third chunk: 2 chunks + 32 tokens (granularity 16).
        other = prompt.copy()
        other[2 * ct + 40 :] += 1
        part = c.lookup(ns, other)
        assert part.matched_tokens == 2 * ct + 32, part
        assert part.stop == "diverged" and part.chunks[-1].partial, part

        assert c.lookup(ns, other, granularity=64).matched_tokens == 2 * ct, "granularity cut"
        assert c.lookup(ns, prompt[:100], min_tokens=200).matched_tokens == 0, "min_tokens"
        assert c.lookup(namespace("lookup-nothing", 64), prompt).matched_tokens == 0

        # explain: the same tokens are stored under another namespace.
        elsewhere = namespace("lookup-else", 64)
        res = c.lookup(elsewhere, prompt, explain=True)
        assert res.matched_tokens == 0
        fps = {m.fingerprint: m for m in res.other_namespaces}
        assert ns.fingerprint in fps and fps[ns.fingerprint].matched_tokens == 4 * ct, res
        assert fps[ns.fingerprint].namespace == ns, "server should name namespaces it was told"


def test_management(server: KVServer) -> None:
    with kvstore.Client(server.tcp_url, shm=False) as c:
        ns = namespace("mgmt", 32)
        chain = put_chain(c, ns, tokens(3 * 256, start=50_000), 256, 32)
        keys = [k for k, _ in chain]
        c.stats()  # write-through to L2 is asynchronous; poll exists
        found = c.exists([*keys, b"\x07" * 32])
        assert all(1 in f for f in found[:3]) and found[3] == (), found

        assert c.pin(keys[:2]) == 2
        pinned = list(c.list(ns, pinned_only=True))
        assert {v.key for v in pinned} == set(keys[:2]), pinned
        listed = list(c.list(ns, page_size=2))  # paginates: 3 chunks, pages of 2
        assert [v.key for v in listed] == sorted(keys), "list must return every chunk once"
        assert all(v.n_tokens == 256 and v.dtype == "bfloat16" for v in listed)
        assert c.pin(keys[:2], pinned=False) == 2

        spaces = {n.fingerprint: n for n in c.namespaces()}
        assert spaces[ns.fingerprint].chunks == 3
        assert spaces[ns.fingerprint].bytes == 3 * 256 * 32

        assert c.delete([keys[2], b"\x08" * 32]) == 1
        assert c.get(keys[2]) is None, "deleted chunk still served"
        assert c.clear(ns) == 2
        assert c.exists(keys[:2]) == [(), ()], "clear left chunks behind"
        with pytest.raises(InvalidArgument, match="namespace or all"):
            c.clear()

        stats = c.stats()
        assert [t.name for t in stats.tiers][:2] == ["memory", "disk"]
        assert stats.puts >= 3 and stats.extra["uptime_s"] >= 0
        assert c.health() is True


def test_zero_copy_lease(server: KVServer) -> None:
    with kvstore.Client(server.unix_url, shm=True) as c:
        ns = namespace("lease-views", 4096)
        data = payload(64 * 4096, 11)
        key, _ = c.put_chunk(ns, ROOT, tokens(64, 7), data, "bfloat16", (64, 2048))
        lease = c.acquire(key)
        assert lease is not None
        with lease:
            joined = b"".join(bytes(v) for v in lease.views())
            assert joined == data.tobytes(), "lease views show other bytes"
            assert c.stats().extra["active_leases"] >= 1
        assert lease.released
        assert c.acquire(b"\x09" * 32) is None
    with kvstore.Client(server.tcp_url, shm=False) as c, pytest.raises(KVStoreError):
        c.acquire(key)


def test_async_client(server: KVServer) -> None:
    async def run(url: str, shm: bool) -> None:
        async with kvstore.AsyncClient(url, shm=shm) as c:
            ns = namespace(f"async-{shm}", 1024)
            data = payload(256 * 1024, 5 + shm)
            key, status = await c.put_chunk(
                ns, ROOT, tokens(256, 900), data, "bfloat16", (256, 512)
            )
            assert status == PutStatus.STORED, status
            assert c.shm_active is shm
            got = await c.get(key)
            assert got is not None and got[1] == data.tobytes(), "async get: wrong bytes"
            out = np.empty_like(data)
            assert await c.get_into(key, out) is not None and np.array_equal(out, data)
            assert (await c.lookup(ns, tokens(256, 900))).matched_tokens == 256
            assert (await c.exists([key]))[0]
            assert [v.key async for v in c.list(ns)] == [key]
            assert await c.health()
            assert await c.get(b"\x03" * 32) is None

    asyncio.run(run(server.unix_url, True))
    asyncio.run(run(server.tcp_url, False))


def test_reflection_and_health_are_on(server: KVServer) -> None:
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(f"unix:{server.socket}") as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= services, services


def test_chunk_larger_than_l1_goes_through_disk(make_server: Callable[..., KVServer]) -> None:
    """L1 cannot take or lend it: puts stage it for L2, gets stream it from there."""
    srv = make_server("tiny", memory="4MiB").start()
    for url, shm in ((srv.unix_url, True), (srv.tcp_url, False)):
        with kvstore.Client(url, shm=shm) as c:
            ns = namespace(f"big-{shm}", 24 * 1024)
            data = payload(256 * 24 * 1024, 77 + shm)  # 6 MiB > the 4 MiB arena
            key, status = c.put_chunk(
                ns, ROOT, tokens(256, 5000 + shm), data, "bfloat16", (256, 12 * 1024)
            )
            assert status == PutStatus.STORED, f"shm={shm}: {status}"
            assert c.exists([key]) == [(2,)], "the chunk should live in L2 only"
            got = c.get(key)
            assert got is not None and got[1] == data.tobytes(), f"shm={shm}: wrong bytes"
            out = np.empty_like(data)
            assert c.get_into(key, out) is not None and np.array_equal(out, data)
    assert srv.stop() == 0, srv.log()


# -- writing in place: reserve, write the views, commit -------------------------------------
def test_reserve_many_writes_in_place_and_the_server_seals(server: KVServer) -> None:
    """One round trip reserves a batch; what is written into the views is what a get
    returns, and the checksum the server computed at Commit is the payload's."""
    import xxhash

    from kvstore.client import chunk_header

    bpt = 4096
    ns = namespace("reserve-many", bpt)
    datas = [payload(256 * bpt, seed=100 + i) for i in range(3)]
    headers, parent = [], ROOT
    for i in range(3):
        h = chunk_header(ns, parent, tokens(256, 256 * i), None, "bfloat16", shape_for(256, bpt))
        headers.append(h)
        parent = h.key
    with kvstore.Client(server.unix_url, shm=True, timeout=30) as c:
        assert (
            c.put_chunk(ns, ROOT, tokens(256), datas[0], "bfloat16", shape_for(256, bpt))[1]
            == PutStatus.STORED
        )
        got = c.reserve(headers)
        assert got[0] == PutStatus.EXISTS, "a stored chunk needs no reservation"
        for res, data in zip(got[1:], datas[1:], strict=True):
            assert isinstance(res, kvstore.client.Reservation), res
            assert c.get(res.header.key) is None, "nothing is visible before commit"
            view = res.contiguous()
            assert view is not None, "a fresh arena hands out one extent per record"
            view[:] = data
            assert res.commit() == PutStatus.STORED
        for h, data in zip(headers, datas, strict=True):
            found = c.get(h.key)
            assert found is not None and found[1] == data.tobytes(), "other bytes came back"
            assert found[0].payload_checksum == xxhash.xxh3_64_intdigest(data), (
                "the server must seal the record with the checksum of what was written"
            )
        assert memory_detail(c)["reservations"] == 0


def test_a_reservation_left_unwritten_is_given_back(server: KVServer) -> None:
    from kvstore.client import chunk_header

    ns = namespace("reserve-abort", 512)
    h = chunk_header(ns, ROOT, tokens(64), None, "bfloat16", shape_for(64, 512))
    with kvstore.Client(server.unix_url, shm=True, timeout=30) as c:
        before = memory_detail(c)["pages_used"]
        (res,) = c.reserve([h])
        assert isinstance(res, kvstore.client.Reservation)
        assert memory_detail(c)["pages_used"] > before
        with pytest.raises(RuntimeError), res:
            raise RuntimeError("the device copy failed")
        detail = memory_detail(c)
        assert (detail["reservations"], detail["pages_used"]) == (0, before), (
            "leaving the with-block without commit must abort the reservation"
        )
        assert c.get(h.key) is None


def test_commit_refuses_bytes_that_do_not_match_a_checksum_given_up_front(
    server: KVServer,
) -> None:
    from kvstore.client import chunk_header
    from kvstore.errors import CorruptRecord

    ns = namespace("reserve-bad", 512)
    data = payload(64 * 512, seed=5)
    h = chunk_header(ns, ROOT, tokens(64), data, "bfloat16", shape_for(64, 512))
    with kvstore.Client(server.unix_url, shm=True, timeout=30) as c:
        (res,) = c.reserve([h], checksum_at_commit=False)
        assert isinstance(res, kvstore.client.Reservation)
        bad = data.copy()
        bad[-1] ^= 1
        res.write(bad)
        with pytest.raises(CorruptRecord):
            res.commit()
        assert c.get(h.key) is None, "bytes that fail their checksum must never be served"


def _stored_then_changed(c: kvstore.Client, tag: str, data: np.ndarray, at: int) -> bytes:
    """Store ``data`` as a chunk, then change its byte ``at`` in the arena, as a rogue
    writer on the host would; the chunk's key."""
    from kvstore.arena import ArenaView

    key, status = c.put_chunk(
        namespace(tag, 4096), ROOT, tokens(256), data, "bfloat16", shape_for(256, 4096)
    )
    assert status == PutStatus.STORED
    lease = c.acquire(key)
    assert lease is not None
    extents, start = lease._extents, lease._offset
    lease.release()
    with ArenaView.open(c.info().shm_path) as rogue:
        rogue.write(extents, start + at, b"\x5a" if data[at] != 0x5A else b"\xa5")
    return key


@pytest.mark.parametrize("verify", [True, False], ids=["client-verifies", "server-verifies"])
def test_a_payload_changed_in_the_arena_is_never_served(server: KVServer, verify: bool) -> None:
    """A rogue writer on the host flips a byte of a committed chunk: whichever side checks,
    the reader gets a miss or a good copy from a lower tier, and the L1 copy is dropped."""
    data = payload(256 * 4096, seed=77)
    with kvstore.Client(server.unix_url, shm=True, timeout=30, verify=verify) as c:
        corrupt = c.stats().tiers[0].corrupt
        key = _stored_then_changed(c, f"rogue-{verify}", data, 12345)
        out = np.zeros(data.size, dtype=np.uint8)
        got = c.get_into(key, out)
        assert got is None or np.array_equal(out, data), "changed bytes were served"
        assert c.stats().tiers[0].corrupt == corrupt + 1, "the bad L1 copy must be counted"


@pytest.mark.parametrize("verify", [True, False], ids=["client-verifies", "server-verifies"])
def test_async_client_never_serves_a_payload_changed_in_the_arena(
    server: KVServer, verify: bool
) -> None:
    data = payload(256 * 4096, seed=78)
    with kvstore.Client(server.unix_url, shm=True, timeout=30) as c:
        key = _stored_then_changed(c, f"rogue-aio-{verify}", data, 999)

    async def read() -> tuple[object, object]:
        async with kvstore.AsyncClient(server.unix_url, shm=True, timeout=30, verify=verify) as ac:
            out = np.zeros(data.size, dtype=np.uint8)
            return await ac.get_into(key, out), out

    got, out = asyncio.run(read())
    assert got is None or np.array_equal(out, data), "changed bytes were served"


def test_a_stray_write_before_commit_is_caught_with_checksum_at_commit(server: KVServer) -> None:
    """The writer hashes what it wrote and commits with that checksum: bytes changed in
    the pages after that (another process writing where it should not) fail the commit."""
    import xxhash

    from kvstore.client import chunk_header
    from kvstore.errors import CorruptRecord

    ns = namespace("reserve-stray", 512)
    data = payload(64 * 512, seed=9)
    h = chunk_header(ns, ROOT, tokens(64), None, "bfloat16", shape_for(64, 512))
    with kvstore.Client(server.unix_url, shm=True, timeout=30) as c:
        (res,) = c.reserve([h])
        assert isinstance(res, kvstore.client.Reservation)
        view = res.contiguous()
        assert view is not None
        view[:] = data
        view[100] ^= 0xFF  # the stray write
        with pytest.raises(CorruptRecord):
            res.commit(xxhash.xxh3_64_intdigest(data))
        assert c.get(h.key) is None, "bytes that fail the writer's checksum must never be served"


def test_commit_many_stores_each_chunk_on_its_own(server: KVServer) -> None:
    """One CommitMany for a batch: the good chunks are stored, the one whose bytes do not
    match its checksum is refused alone, with the error a single commit would raise."""
    import xxhash

    from kvstore.client import chunk_header
    from kvstore.errors import CorruptRecord

    ns = namespace("commit-many", 512)
    datas = [payload(64 * 512, seed=200 + i) for i in range(3)]
    headers = [
        chunk_header(ns, ROOT, tokens(64, 64 * i), None, "bfloat16", shape_for(64, 512))
        for i in range(3)
    ]
    with kvstore.Client(server.unix_url, shm=True, timeout=30) as c:
        held = c.reserve(headers)
        assert all(isinstance(r, kvstore.client.Reservation) for r in held), held
        sums = []
        for res, data in zip(held, datas, strict=True):
            assert isinstance(res, kvstore.client.Reservation)
            view = res.contiguous()
            assert view is not None
            view[:] = data
            sums.append(xxhash.xxh3_64_intdigest(data))
        view = held[1].contiguous()  # type: ignore[union-attr]
        assert view is not None
        view[7] ^= 1  # changed after its writer hashed it
        got = c.commit(held, sums)  # type: ignore[arg-type]
        assert got[0] == got[2] == PutStatus.STORED, got
        assert isinstance(got[1], CorruptRecord), f"the damaged chunk must fail alone: {got}"
        assert c.get(headers[0].key) is not None and c.get(headers[2].key) is not None
        assert c.get(headers[1].key) is None
        assert memory_detail(c)["reservations"] == 0
        with pytest.raises(InvalidArgument, match="already committed"):
            c.commit([held[0]])  # type: ignore[list-item]
        (again,) = c.reserve(
            [chunk_header(ns, ROOT, tokens(64, 999), None, "bfloat16", shape_for(64, 512))]
        )
        assert isinstance(again, kvstore.client.Reservation)
        with pytest.raises(InvalidArgument, match="twice"):
            c.commit([again, again])
        assert not again.done, "a refused batch must not use up its reservations"
        again.abort()
