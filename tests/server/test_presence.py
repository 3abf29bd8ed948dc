"""Lookups a same-host client answers by the server's presence filter (``kvstore.presence``,
``kvstore.sdk.presence``): both clients (the contract suite's ``drive``), real
kvstore-server processes."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.keys import ROOT, Namespace
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
    successor holds. The client checks the file and its nonce before each answer: after
    a restart in a new file (SIGTERM) and after one that took the same file over
    (SIGKILL, ``--shm-path``), a prompt the new server stored is found."""
    arena = tmp_path / "arena"
    srv = make_server(f"presence-restart-{drive.kind}", args=["--shm-path", str(arena)]).start()
    ns = namespace(f"presence-restart-{drive.kind}", BPT)
    prompts = [tokens(256, 70_000 + 1000 * i) for i in range(2)]

    async def body(kv: Any) -> None:
        stops = (signal.SIGTERM, signal.SIGKILL)
        for i, (sig, prompt) in enumerate(zip(stops, prompts, strict=True)):
            await kv.lookup(ns, tokens(256, 1))  # the namespace described: asked once
            answered = _client(kv)._presence.answered
            assert (await kv.lookup(ns, prompt)).matched_tokens == 0
            assert _client(kv)._presence.answered == answered + 1, "answered by the filter"
            srv.stop(sig)
            srv.start()
            await drive.run(_store_one(ns, prompt), srv.unix_url)
            got = await kv.lookup(ns, prompt)
            assert got.matched_tokens == 256, f"restart {i} ({sig.name}): {got}"

    drive(body, server=srv)


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
