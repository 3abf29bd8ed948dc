"""Chunk keys: the documented test vectors, and the scheme re-derived independently."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import (
    ROOT,
    Namespace,
    chunk_keys,
    common_units,
    parse_key,
    sub_hashes,
    tokens_to_bytes,
)

NS = Namespace(model="tiny-llama", dtype="bfloat16", layout="L4-H2-D64-B16-LBHNC", device="cpu")
VECTORS = [
    "935bb8726dc181ce4ecb8acf8985326856c6718542d605ffa500e7770a590535",
    "f55fe95ec5c10a224fdb149e9329481e4e82bc1be1407642cb4a6d369d9ebdf2",
    "5a20d9c19cb649eb4165bb54b5e443fe1266f9a8a7277cbcd1d868de8285c8d1",
]


def test_documented_vectors() -> None:
    assert NS.fingerprint.hex() == "160d13ba8acea681d88954dd6d86f588", (
        "fingerprint changed: docs/keys.md is stale"
    )
    assert Namespace(model="m").fingerprint.hex() == "586dd7cc9d407f0c06e5398ef428ab0e"
    keys = chunk_keys(NS.fingerprint, list(range(10)), 4)
    assert [k.hex() for k in keys] == VECTORS, "chunk key scheme changed: docs/keys.md is stale"
    assert sub_hashes(tokens_to_bytes(range(8)), 4).hex() == "1a4a42ae0321949513df576b872bda6e"


def test_independent_derivation() -> None:
    """Recompute the keys from the written spec with struct and hashlib only."""
    canonical = (
        b'{"device":"cpu","dtype":"bfloat16","extra":[],"layout":"L4-H2-D64-B16-LBHNC",'
        b'"lora":"","model":"tiny-llama","pp_rank":0,"pp_size":1,"revision":"","salt":"",'
        b'"tp_rank":0,"tp_size":1}'
    )
    fp = hashlib.blake2b(canonical, digest_size=16, person=b"kvstore-ns-v1").digest()
    assert fp == NS.fingerprint
    parent = bytes(32)
    for i, (start, end) in enumerate([(0, 4), (4, 8), (8, 10)]):
        body = struct.pack(f"<{end - start}I", *range(start, end))
        parent = hashlib.blake2b(
            parent + fp + body, digest_size=32, person=b"kvstore-chunk-v1"
        ).digest()
        assert parent.hex() == VECTORS[i]


def test_same_keys_in_another_process_with_other_hash_seed() -> None:
    code = (
        "from kvstore.keys import Namespace, chunk_keys;"
        "ns=Namespace(model='tiny-llama', dtype='bfloat16', "
        "layout='L4-H2-D64-B16-LBHNC', device='cpu');"
        "print(chunk_keys(ns.fingerprint, list(range(10)), 4)[-1].hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == VECTORS[-1]


def test_namespace_fields_all_change_the_fingerprint() -> None:
    base = Namespace(model="m")
    variants = [
        Namespace(model="m2"),
        Namespace(model="m", revision="r"),
        Namespace(model="m", dtype="float16"),
        Namespace(model="m", layout="x"),
        Namespace(model="m", device="cuda"),
        Namespace(model="m", tp_rank=1, tp_size=2),
        Namespace(model="m", pp_rank=1, pp_size=2),
        Namespace(model="m", lora="a"),
        Namespace(model="m", salt="tenant-b"),
        Namespace(model="m", extra=(("k", "v"),)),
    ]
    fps = {v.fingerprint for v in variants} | {base.fingerprint}
    assert len(fps) == len(variants) + 1, "two different namespaces share a fingerprint"


def test_prefix_property_and_short_tail() -> None:
    toks = list(range(1000, 1700))
    full = chunk_keys(NS.fingerprint, toks, 256)
    assert len(full) == 3
    assert chunk_keys(NS.fingerprint, toks[:512], 256) == full[:2]
    assert chunk_keys(NS.fingerprint, toks, 256, full_only=True) == full[:2]
    other = toks[:300] + [7] + toks[301:]
    k2 = chunk_keys(NS.fingerprint, other, 256)
    assert k2[0] == full[0] and k2[1] != full[1] and k2[2] != full[2]
    assert full[0] != ROOT


def test_bad_tokens_rejected() -> None:
    with pytest.raises(InvalidArgument):
        tokens_to_bytes([-1])
    with pytest.raises(InvalidArgument):
        tokens_to_bytes([2**32])
    with pytest.raises(InvalidArgument):
        tokens_to_bytes([1.5])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        parse_key("zz")
    with pytest.raises(InvalidArgument):
        Namespace(model="")
    with pytest.raises(InvalidArgument):
        Namespace(model="m", tp_rank=2, tp_size=2)


def test_common_units() -> None:
    a = sub_hashes(tokens_to_bytes(range(64)), 16)
    b = sub_hashes(tokens_to_bytes([*range(40), 9999, *range(41, 64)]), 16)
    assert common_units(a, a) == 4
    assert common_units(a, b) == 2, "tokens 0..39 agree: 2 whole units of 16"
    assert common_units(a, sub_hashes(tokens_to_bytes(range(20)), 16)) == 1
    assert common_units(a, b"") == 0
