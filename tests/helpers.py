"""Shared builders for tests: records with known payloads."""

from __future__ import annotations

import numpy as np

from kvstore.keys import ROOT, ChunkKey, Fingerprint, Namespace, chunk_key, tokens_to_bytes
from kvstore.records import RecordHeader, make_header

NS = Namespace(model="test-model", dtype="bfloat16", layout="test")
FP = NS.fingerprint


def payload_bytes(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def make_chunk(
    tokens: list[int] | range,
    *,
    parent: ChunkKey = ROOT,
    fp: Fingerprint = FP,
    bytes_per_token: int = 64,
    seed: int | None = None,
) -> tuple[RecordHeader, bytes]:
    """A raw bfloat16 record of shape (n_tokens, bytes_per_token // 2)."""
    tb = tokens_to_bytes(list(tokens))
    n = len(tb) // 4
    payload = payload_bytes(
        n * bytes_per_token, seed if seed is not None else int(tokens[0]) * 7919 + n
    )
    header = make_header(
        key=chunk_key(parent, fp, tb),
        parent=parent,
        fingerprint=fp,
        token_bytes=tb,
        dtype="bfloat16",
        shape=(n, bytes_per_token // 2),
        payload=payload,
    )
    return header, payload


def make_chain(
    tokens: list[int], chunk_tokens: int, *, fp: Fingerprint = FP, bytes_per_token: int = 64
) -> list[tuple[RecordHeader, bytes]]:
    """Records for every chunk of a prompt (the last may be short)."""
    out = []
    parent = ROOT
    for s in range(0, len(tokens), chunk_tokens):
        h, p = make_chunk(
            tokens[s : s + chunk_tokens],
            parent=parent,
            fp=fp,
            bytes_per_token=bytes_per_token,
            seed=s + len(tokens),
        )
        out.append((h, p))
        parent = h.key
    return out
