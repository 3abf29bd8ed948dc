"""Lookups a same-host client answers by the server's presence filter (``kvstore.presence``,
``kvstore.sdk.presence``): both clients (the contract suite's ``drive``), real
kvstore-server processes."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.errors import KVStoreError
from kvstore.keys import ROOT, Namespace
from kvstore.sdk.presence import REPORT_EVERY, REPORT_S
from kvstore.testing.server import KVServer
from kvstore.types import LookupResult
from tests.server.helpers import namespace, payload, tokens
from tests.server.test_client_contract import Drive, _client, _delta, _requests, drive

__all__ = ["drive"]  # the fixture, used by name

BPT = 64  # bytes per token of the chunks stored here


async def _put_prompt(kv: Any, ns: Namespace, prompt: np.ndarray) -> None:
    ct = (await kv.info()).chunk_tokens
    parent = ROOT
    for i in range(0, len(prompt), ct):
        part = prompt[i : i + ct]
        data = payload(len(part) * BPT, i + int(prompt[0]))
        parent, status = await kv.put_chunk(ns, parent, part, data, "bfloat16", (len(part), 32))
        assert status.ok, status


def _same(a: LookupResult, b: LookupResult) -> bool:
    return (a.matched_tokens, a.total_tokens, a.stop, a.stop_chunk, bytes(a.chunks.key_bytes)) == (
        b.matched_tokens,
        b.total_tokens,
        b.stop,
        b.stop_chunk,
        bytes(b.chunks.key_bytes),
    )


def test_a_miss_is_answered_without_a_call_and_a_hit_still_asks(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """A prompt nothing was stored for: answered by the client (no Lookup reaches the
    server) exactly as the server answers it (a client without shared memory asks it).
    Stored prompts, a prompt sharing only the first tokens of a stored chunk (a partial
    match through the server's sibling index), and a prompt shorter than one unit all
    go to the server. The lookups answered by the filter are counted in the server's
    Stats with the client's next Lookup (a repeated one is not counted, as there)."""
    srv = make_server(f"presence-{drive.kind}").start()
    ns = namespace(f"presence-{drive.kind}", BPT)
    stored = tokens(512, 10_000)
    diverged = np.concatenate([stored[:40], tokens(472, 50_000)])
    fresh = [tokens(512, 20_000 + 1000 * i) for i in range(5)]

    async def body(kv: Any) -> None:
        info = await kv.info()
        assert info.presence_bytes > 0 and info.presence_nonce != 0, info
        await _put_prompt(kv, ns, stored)
        await kv.lookup(ns, stored)  # the namespace's description reaches the server first
        now = time.monotonic()
        _client(kv)._presence.clock = lambda: now  # no count told in passing meanwhile
        s0 = await kv.stats()
        answers = [await kv.lookup(ns, t) for t in fresh]
        again = await kv.lookup(ns, fresh[0], repeat=True)  # answered alike, not counted
        assert _same(again, answers[0])
        s1 = await kv.stats()
        assert _delta(_requests(s1), _requests(s0), "Lookup") == {"Lookup": 0}, (
            "misses of prompts nothing was stored for were asked of the server"
        )
        assert _client(kv)._presence.answered == len(fresh) + 1
        for a in answers:
            assert (a.matched_tokens, a.stop, a.stop_chunk) == (0, "not_stored", 0), a
        hit = await kv.lookup(ns, stored)
        part = await kv.lookup(ns, diverged)
        short = await kv.lookup(ns, stored[:8])
        s2 = await kv.stats()
        assert _delta(_requests(s2), _requests(s1), "Lookup") == {"Lookup": 3}
        assert hit.matched_tokens == 512
        assert part.matched_tokens == 32 and part.stop == "diverged", part
        assert s2.lookups - s1.lookups == 3 + len(fresh), "filtered lookups counted late"
        assert s2.lookup_tokens - s1.lookup_tokens == 512 + 512 + 8 + 512 * len(fresh)
        asked = _ask_all([*fresh, stored, diverged, stored[:8]], ns)
        plain = await drive.run(asked, srv.unix_url, shm=False)
        mine = [*answers, hit, part, short]
        for i, (m, p) in enumerate(zip(mine, plain, strict=True)):
            assert _same(m, p), f"prompt {i}: filter {m} against the server {p}"

    drive(body, server=srv)


def _ask_all(prompts: list[np.ndarray], ns: Namespace) -> Callable[[Any], Any]:
    async def body(kv: Any) -> list[LookupResult]:
        assert not _client(kv)._presence.active, "shm=False maps no filter"
        return [await kv.lookup(ns, t) for t in prompts]

    return body


def test_a_client_follows_a_restarted_server(
    drive: Drive, make_server: Callable[..., KVServer], tmp_path: Path
) -> None:
    """A filter read from a server that is gone would say "nothing stored" for what its
    successor holds. Restarted at another path after SIGKILL (the dead server's file
    stays behind, still signed: it is trusted only while vouched for, here past that on
    the client's clock); after SIGTERM (it stopped vouching at once); at the same path
    after SIGKILL, with no filter and so a shorter file (the dead server's file is
    replaced, not cut short under the client's mapping: that would be SIGBUS). Each
    time a prompt the new server stored is found."""
    arena = tmp_path / "arena"
    srv = make_server(f"presence-restart-{drive.kind}", args=["--shm-path", str(arena)]).start()
    ns = namespace(f"presence-restart-{drive.kind}", BPT)
    restarts = [
        (signal.SIGKILL, [], 60.0),  # its arena stays behind, at the path named
        (signal.SIGTERM, ["--shm-path", str(arena)], 0.0),  # takes that file's path over
        (signal.SIGKILL, ["--shm-path", str(arena), "--presence-size", "0"], 0.0),
    ]

    async def body(kv: Any) -> None:
        view = _client(kv)._presence
        for i, (sig, args, later) in enumerate(restarts):
            prompt = tokens(256, 70_000 + 1000 * i)
            await kv.lookup(ns, tokens(256, 1))  # the namespace described: asked once
            answered = view.answered
            assert (await kv.lookup(ns, prompt)).matched_tokens == 0
            assert view.answered == answered + 1, f"restart {i}: answered by the filter"
            srv.stop(sig)
            srv.args = args
            srv.start()
            await drive.run(_store_one(ns, prompt), srv.unix_url)
            view.clock = lambda later=later: time.monotonic() + later
            got = await kv.lookup(ns, prompt)
            assert got.matched_tokens == 256, f"restart {i} ({sig.name} {args}): {got}"
            view.clock = time.monotonic

    drive(body, server=srv)


def test_a_filter_nobody_vouches_for_is_not_believed(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """A server stopped, or killed and not restarted: its lookups fail as they did before
    the filter, once it no longer vouches (at once after SIGTERM; after SIGKILL when
    its last vouch runs out, here moved past on the client's clock)."""
    ns = namespace(f"presence-dead-{drive.kind}", BPT)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        srv = make_server(f"presence-dead-{drive.kind}-{sig.name}").start()

        async def body(kv: Any, srv: KVServer = srv, sig: signal.Signals = sig) -> None:
            view = _client(kv)._presence
            await kv.lookup(ns, tokens(256, 1))
            answered = view.answered
            assert (await kv.lookup(ns, tokens(256, 5000))).matched_tokens == 0
            assert view.answered == answered + 1
            srv.stop(sig)
            if sig == signal.SIGKILL:
                view.clock = lambda: time.monotonic() + 60
            with pytest.raises(KVStoreError):
                await kv.lookup(ns, tokens(256, 6000), timeout=2)
            assert view.answered == answered + 1, "a dead server's filter answered"

        drive(body, server=srv, timeout=5)


def _store_one(ns: Namespace, prompt: np.ndarray) -> Callable[[Any], Any]:
    async def body(kv: Any) -> None:
        await _put_prompt(kv, ns, prompt)

    return body


def test_a_server_without_a_filter_is_asked_every_time(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """``--presence-size 0``: nothing offered, every lookup is a Lookup."""
    srv = make_server(f"presence-off-{drive.kind}", args=["--presence-size", "0"]).start()
    ns = namespace(f"presence-off-{drive.kind}", BPT)

    async def body(kv: Any) -> None:
        assert (await kv.info()).presence_bytes == 0
        s0 = await kv.stats()
        for i in range(3):
            assert (await kv.lookup(ns, tokens(256, 90_000 + 1000 * i))).matched_tokens == 0
        s1 = await kv.stats()
        assert _delta(_requests(s1), _requests(s0), "Lookup") == {"Lookup": 3}
        assert not _client(kv)._presence.active

    drive(body, server=srv)


def test_lookups_answered_by_the_filter_are_told_to_the_server_in_passing(
    drive: Drive, make_server: Callable[..., KVServer]
) -> None:
    """A client whose every lookup is answered by the filter sends no Lookup to carry its
    counts: it tells them in passing (a Lookup of nothing, not waited for) every
    ``REPORT_EVERY`` answers, or once ``REPORT_S`` went by since it last did."""
    srv = make_server(f"presence-tell-{drive.kind}").start()
    ns = namespace(f"presence-tell-{drive.kind}", BPT)

    async def body(kv: Any) -> None:
        view = _client(kv)._presence
        await kv.lookup(ns, tokens(256, 1))  # the namespace described: asked once
        now = time.monotonic()
        view.clock = lambda: now
        s0 = await kv.stats()
        n = REPORT_EVERY + 3
        for i in range(n):
            assert (await kv.lookup(ns, tokens(64, 100_000 + 64 * i))).matched_tokens == 0
        assert view.answered >= n
        told = await _lookups_grow(kv, s0.lookups, REPORT_EVERY)
        assert told.lookup_tokens - s0.lookup_tokens == 64 * REPORT_EVERY, "told by count"
        view.clock = lambda: now + REPORT_S + 0.5
        await kv.lookup(ns, tokens(64, 1))
        later = await _lookups_grow(kv, told.lookups, 4)
        assert later.lookup_tokens - told.lookup_tokens == 64 * 4, "told by age"

    drive(body, server=srv)


async def _lookups_grow(kv: Any, before: int, by: int) -> Any:
    """The server's Stats once its lookups grew by ``by`` (a Tell lands when it lands)."""
    deadline = time.monotonic() + 10
    while True:
        got = await kv.stats()
        if got.lookups - before >= by or time.monotonic() > deadline:
            assert got.lookups - before == by, f"lookups grew by {got.lookups - before}"
            return got
        await asyncio.sleep(0.05)
