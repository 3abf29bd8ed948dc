"""Chunks for the server tests: namespaces, payloads and chains with known bytes."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.keys import ROOT, ChunkKey, Namespace
from kvstore.records import RecordHeader
from kvstore.sdk.client import Client

NS = Namespace(model="server-test", dtype="bfloat16", layout="L2-H4-D64", device="cpu")


def namespace(tag: str, bytes_per_token: int = 512) -> Namespace:
    """A namespace of its own per test (the layout pins the bytes per token)."""
    return Namespace(model="server-test", dtype="bfloat16", layout=f"{tag}-bpt{bytes_per_token}")


def memory_detail(client: Client) -> dict[str, Any]:
    """The L1 tier's detail in the server's stats (active_leases, reservations, pages_used)."""
    return client.stats().tiers[0].detail


def payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def tokens(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint32)


def shape_for(n_tokens: int, bytes_per_token: int) -> tuple[int, int]:
    """bfloat16 shape of a chunk: (tokens, bytes_per_token // 2)."""
    return (n_tokens, bytes_per_token // 2)


def put_chain(
    client: object,
    ns: Namespace,
    toks: np.ndarray,
    chunk_tokens: int,
    bytes_per_token: int,
    seed: int = 0,
) -> list[tuple[ChunkKey, np.ndarray]]:
    """Put every chunk of a prompt; (key, payload) of each, in order."""
    out = []
    parent = ROOT
    for i, s in enumerate(range(0, len(toks), chunk_tokens)):
        part = toks[s : s + chunk_tokens]
        data = payload(len(part) * bytes_per_token, seed + i)
        key, status = client.put_chunk(  # type: ignore[attr-defined]
            ns, parent, part, data, "bfloat16", shape_for(len(part), bytes_per_token)
        )
        assert status.ok, f"chunk {i} not stored: {status}"
        out.append((key, data))
        parent = key
    return out


def chunk_header_for(
    ns: Namespace, toks: np.ndarray, bytes_per_token: int, seed: int, parent: ChunkKey = ROOT
) -> RecordHeader:
    """The header of a chunk whose payload is ``payload(len(toks) * bpt, seed)``."""
    from kvstore.sdk.client import chunk_header

    data = payload(len(toks) * bytes_per_token, seed)
    return chunk_header(ns, parent, toks, data, "bfloat16", shape_for(len(toks), bytes_per_token))
