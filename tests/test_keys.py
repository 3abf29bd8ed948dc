"""Chunk keys: the documented test vectors, and the scheme re-derived independently."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import (
    KEY_SCHEME,
    ROOT,
    Namespace,
    chunk_key,
    chunk_keys,
    common_units,
    parse_key,
    sub_hashes,
    tokens_to_bytes,
)

NS = Namespace(model="tiny-llama", dtype="bfloat16", layout="L4-H2-D64-B16-LBHNC", device="cpu")
VECTORS = [
    "3a037f635662b70523775ba2ab217eac31d1ccdb5d09fe4c76c7b523cd15de0e",
    "18e291af5dc126738a25c65360ee47319628e5403a3a22ff9172f016fe240315",
    "f425d3bb8b7189ef62dea31fe6cfab2e3c021a9777368517aea55865209a1e08",
]


def test_documented_vectors() -> None:
    assert NS.fingerprint.hex() == "c1d977bed46844bc9feba9de04e16e37", (
        "fingerprint changed: docs/keys.md is stale"
    )
    assert Namespace(model="m").fingerprint.hex() == "e07ae01a8196bb485c91b6108f9e3d12"
    keys = chunk_keys(NS.fingerprint, list(range(10)), 4)
    assert [k.hex() for k in keys] == VECTORS, "chunk key scheme changed: docs/keys.md is stale"
    assert sub_hashes(tokens_to_bytes(range(8)), 4).hex() == "3c7e9a5a06b50989a69690e7fec48875"
    assert KEY_SCHEME == "kvstore-chunk-v2"


def block(tag: bytes) -> bytes:
    """The spec's block(tag): the tag, zero-padded to one 64-byte SHA-256 block."""
    return tag.ljust(64, b"\0")


def test_independent_derivation() -> None:
    """Recompute the keys from the written spec with struct and hashlib only."""
    canonical = (
        b'{"device":"cpu","dtype":"bfloat16","extra":[],"layout":"L4-H2-D64-B16-LBHNC",'
        b'"lora":"","model":"tiny-llama","pp_rank":0,"pp_size":1,"revision":"","salt":"",'
        b'"tp_rank":0,"tp_size":1}'
    )
    fp = hashlib.sha256(block(b"kvstore-ns-v2") + canonical).digest()[:16]
    assert fp == NS.fingerprint
    parent = bytes(32)
    for i, (start, end) in enumerate([(0, 4), (4, 8), (8, 10)]):
        body = struct.pack(f"<{end - start}I", *range(start, end))
        parent = hashlib.sha256(block(b"kvstore-chunk-v2") + fp + parent + body).digest()
        assert parent.hex() == VECTORS[i]
    subs = b"".join(
        hashlib.sha256(block(b"kvstore-sub-v2") + struct.pack(f"<{n}I", *range(n))).digest()[:8]
        for n in (4, 8)
    )
    assert subs == sub_hashes(tokens_to_bytes(range(8)), 4)


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


def test_every_token_form_gives_the_same_keys() -> None:
    """Lists, tuples, ranges and arrays of any int dtype, byte order or stride agree."""
    toks = list(range(1000, 1700))
    want = chunk_keys(NS.fingerprint, toks, 256)
    parent, chained = ROOT, []
    for s in range(0, len(toks), 256):
        parent = chunk_key(parent, NS.fingerprint, tokens_to_bytes(toks[s : s + 256]))
        chained.append(parent)
    assert chained == want, "chunk_keys and chained chunk_key calls disagree"
    wide = np.array([0, *toks], dtype=np.int64)
    forms: list[Sequence[int] | np.ndarray] = [
        tuple(toks),
        range(1000, 1700),
        np.array(toks, dtype="<u4"),
        np.array(toks, dtype=">u4"),
        np.array(toks, dtype=np.int32),
        np.array(toks, dtype=">i8"),
        np.array(toks, dtype=np.uint64),
        np.repeat(wide, 2)[2::2],  # not contiguous
    ]
    for form in forms:
        assert chunk_keys(NS.fingerprint, form, 256) == want, type(form)
        assert tokens_to_bytes(form) == tokens_to_bytes(toks)
    assert tokens_to_bytes(np.array([], dtype=np.float32)) == b""


def test_bad_tokens_rejected() -> None:
    with pytest.raises(InvalidArgument):
        tokens_to_bytes([-1])
    with pytest.raises(InvalidArgument):
        tokens_to_bytes([2**32])
    with pytest.raises(InvalidArgument):
        tokens_to_bytes([1.5])  # type: ignore[list-item]
    for dtype in (np.int8, np.int32, np.int64):
        with pytest.raises(InvalidArgument):
            tokens_to_bytes(np.array([5, -1], dtype=dtype))
    with pytest.raises(InvalidArgument):
        tokens_to_bytes(np.array([2**32], dtype=np.uint64))
    with pytest.raises(InvalidArgument):
        tokens_to_bytes(np.array([1.0]))
    with pytest.raises(InvalidArgument):
        tokens_to_bytes(np.zeros((2, 2), dtype=np.int64))
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
