"""A lookup that lends what it matched (``lookup_lend``), and a second client that loads
through those leases (``adopt``) with no call of its own: both clients (the contract
suite's ``drive``), real kvstore-server processes with L1 and LMDB."""

from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

import kvstore
from kvstore.keys import ROOT, Namespace
from kvstore.sdk import LeaseBase, LentLease
from kvstore.testing.server import KVServer
from kvstore.types import PutStatus
from tests.server.helpers import namespace, payload, tokens
from tests.server.test_client_contract import (
    Awaited,
    Drive,
    _delta,
    _requests,
    _unwrap,
    drive,
    memory_detail_of,
)

__all__ = ["drive"]  # the fixture, used by name

BPT = 256  # bytes per token of the chunks stored here
N = 8


def _held(stats: Any) -> tuple[int, int]:
    """(L1 leases, L2 loans) the server holds."""
    return memory_detail_of(stats)["active_leases"], stats.tiers[1].detail["loans"]


def _store(drive: Drive, srv: KVServer, ns: Namespace, prompt: np.ndarray) -> list[Any]:
    async def body(kv: Any) -> list[Any]:
        ct = (await kv.info()).chunk_tokens
        assert ct == 256, ct
        parent, out = ROOT, []
        for i in range(N):
            data = payload(ct * BPT, 500 + i)
            part = prompt[i * ct : (i + 1) * ct]
            parent, status = await kv.put_chunk(ns, parent, part, data, "bfloat16", (ct, BPT // 2))
            assert status == PutStatus.STORED
            out.append((parent, data))
        return out

    return list(drive(body, server=srv))


async def _second(drive: Drive, url: str) -> Any:
    """Another client of the same kind (the worker beside a scheduler's client)."""
    if drive.kind == "Client":
        return Awaited(kvstore.Client(url, timeout=30))
    return kvstore.AsyncClient(url, timeout=30)


def test_a_lookup_lends_its_matches_and_another_client_loads_through_them(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """Chunks 0-2 in L1, 3-7 in L2 only. One Lookup with ``lend_from`` = one chunk lends
    chunks 1-7 to a holder with no Session: 1-2 as L1 leases, 3-7 where they lie in
    LMDB's file; chunk 0 (before ``lend_from``) not at all. A second client takes them
    (after a pickle, as they reach a worker), copies them verified, and ends them in
    the holder's name: no AcquireMany, one Release. Without ``reads_disk`` only L1's are
    lent; past the match, nothing."""
    srv = make_server(f"lend-{drive.kind}").start()
    ns = namespace(f"lend-{drive.kind}", BPT)
    prompt = tokens(N * 256, 31_000)
    chunks = _store(drive, srv, ns, prompt)
    keys = [k for k, _ in chunks]
    assert srv.stop() == 0, srv.log()
    srv = make_server(f"lend-{drive.kind}", data_dir=srv.data_dir).start()

    async def body(kv: Any) -> None:
        await kv.release_many(await kv.acquire_many(keys[:3]))  # promoted into L1
        assert await kv.exists(keys) == [(1, 2)] * 3 + [(2,)] * 5
        holder = f"worker-{uuid.uuid4().hex}"
        before = await kv.stats()
        result, lent = await kv.lookup_lend(
            ns, prompt, lend_from=256, holder=holder, reads_disk=True
        )
        assert result.matched_tokens == N * 256, result
        assert lent[0] is None, "chunk 0 is before lend_from"
        assert all(isinstance(x, LentLease) for x in lent[1:]), lent
        assert [x.on_disk for x in lent[1:]] == [False] * 2 + [True] * 5, lent
        assert {x.holder for x in lent[1:]} == {holder}
        assert _held(await kv.stats()) == (2, 5), "2 L1 leases, 5 loans"

        worker = await _second(drive, srv.unix_url)
        try:
            got = _unwrap(await worker.adopt(pickle.loads(pickle.dumps(lent[1:]))))
            assert all(isinstance(x, LeaseBase) for x in got), got
            out = np.zeros(256 * BPT, dtype=np.uint8)
            for i, lease in enumerate(got, start=1):
                assert lease.holder == holder
                assert lease.read_verified(out) and np.array_equal(out, chunks[i][1]), i
            assert await worker.release_many(got) == 7, "every lent lease was still held"
        finally:
            await worker.close()
        after = await kv.stats()
        assert _held(after) == (0, 0)
        calls = _delta(_requests(after), _requests(before), "Lookup", "AcquireMany", "Release")
        assert calls == {"Lookup": 1, "AcquireMany": 0, "Release": 1}, calls

        _, only_l1 = await kv.lookup_lend(ns, prompt, lend_from=0)
        assert [x is not None for x in only_l1] == [True] * 3 + [False] * 5, only_l1
        assert {x.holder for x in only_l1 if x} == {_session(kv)}, "default: the caller's"
        assert _held(await kv.stats()) == (3, 0)
        mine = _unwrap(await kv.adopt([x for x in only_l1 if x]))
        assert await kv.release_many(mine) == 3
        _, past = await kv.lookup_lend(ns, prompt, lend_from=N * 256)
        assert past == [None] * N and _held(await kv.stats()) == (0, 0)

        # Lent, then not loaded (the request went away): ended without being taken.
        _, unused = await kv.lookup_lend(ns, prompt, holder=holder, reads_disk=True)
        assert _held(await kv.stats()) == (3, 5)
        await kv.release_lent([x for x in unused if x])
        deadline = time.monotonic() + 10
        while _held(await kv.stats()) != (0, 0):
            assert time.monotonic() < deadline, "release_lent ended nothing"
            await asyncio.sleep(0.02)

    drive(body, server=srv)
    assert srv.stop() == 0, srv.log()


def _session(kv: Any) -> str:
    return str((kv.client if isinstance(kv, Awaited) else kv).session_id)


def test_lent_leases_nobody_takes_expire_and_a_restart_voids_them(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """A holder without a Session renews nothing: leases no load takes end with their
    lease (300 ms here) instead of holding pages for as long as the lender lives. Leases
    lent by a server since restarted are not taken (another arena): None, acquire."""
    srv = make_server(f"lend-expiry-{drive.kind}", args=["--lease-ms", "300"]).start()
    ns = namespace(f"lend-expiry-{drive.kind}", BPT)
    prompt = tokens(N * 256, 41_000)
    _store(drive, srv, ns, prompt)

    async def body(kv: Any) -> list[Any]:
        _, lent = await kv.lookup_lend(ns, prompt, holder="nobody", reads_disk=True)
        assert all(x is not None for x in lent), lent
        assert sum(_held(await kv.stats())) == N
        deadline = time.monotonic() + 10
        while sum(_held(await kv.stats())):
            assert time.monotonic() < deadline, "lent leases outlived their lease_ms"
            await asyncio.sleep(0.05)
        assert await kv.adopt(lent) == [None] * N, "leases past valid_until were taken"
        _, again = await kv.lookup_lend(ns, prompt, holder="nobody")
        return list(again)

    stale = drive(body, server=srv)
    assert srv.stop() == 0, srv.log()
    srv = make_server(f"lend-expiry-{drive.kind}", data_dir=srv.data_dir).start()

    async def restarted(kv: Any) -> None:
        assert await kv.adopt(stale) == [None] * N, "a restarted server's leases were taken"

    drive(restarted, server=srv)
    assert srv.stop() == 0, srv.log()


def test_a_lookup_asked_twice_for_sub_hashes_lends_once(drive: Drive) -> None:
    """A lookup by keys that stops inside a chunk is asked again with that chunk's
    sub-hashes: only the answer in full lends, so nothing is lent twice."""

    async def body(kv: Any) -> None:
        ns = namespace(f"lend-twice-{drive.kind}", BPT)
        prompt = tokens(4 * 256, 51_000)
        parent = ROOT
        for i in range(4):
            data = payload(256 * BPT, 600 + i)
            part = prompt[i * 256 : (i + 1) * 256]
            parent, status = await kv.put_chunk(ns, parent, part, data, "bfloat16", (256, BPT // 2))
            assert status.ok
        other = prompt.copy()
        other[2 * 256 + 40 :] += 1  # diverges 40 tokens into the third chunk
        client = kv.client if isinstance(kv, Awaited) else kv
        client.inline_sub_hashes = 0  # keys only: the partial match needs a second ask
        before = await kv.stats()
        held = memory_detail_of(before)["active_leases"]
        result, lent = await kv.lookup_lend(ns, other)
        assert result.matched_tokens == 2 * 256 + 32 and result.chunks[-1].partial, result
        after = await kv.stats()
        assert _delta(_requests(after), _requests(before), "Lookup") == {"Lookup": 2}
        assert memory_detail_of(after)["active_leases"] - held == 3 == sum(map(bool, lent))
        await kv.release_many(_unwrap(await kv.adopt([x for x in lent if x])))

    drive(body)
