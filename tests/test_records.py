"""Chunk records: round trips for every codec, and every kind of damage is caught."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import CorruptRecord, InvalidArgument
from kvstore.records import (
    Codec,
    build,
    decode_payload,
    make_header,
    parse_header,
    transcode,
    verify,
)
from tests.helpers import FP, make_chunk


@pytest.mark.parametrize("codec", list(Codec))
def test_round_trip(codec: Codec) -> None:
    header, payload = make_chunk(range(100, 164))
    blob = transcode(build(header, payload), codec)
    h = verify(blob, expect_key=header.key)
    assert h.codec == codec
    assert (h.key, h.parent, h.fingerprint, h.token_bytes) == (
        header.key,
        header.parent,
        header.fingerprint,
        header.token_bytes,
    )
    assert h.shape == header.shape and h.dtype == "bfloat16" and h.raw_size == len(payload)
    assert bytes(decode_payload(h, memoryview(blob)[h.header_size :])) == payload
    assert list(h.tokens) == list(range(100, 164))
    assert h.header_size % 64 == 0, "payload must start 64-byte aligned"


def test_shuffle_compresses_bf16_better_than_plain_zstd() -> None:
    import torch

    kv = (torch.randn(256, 8, 128) * 0.5).to(torch.bfloat16)
    raw = kv.view(torch.uint8).numpy().tobytes()
    from kvstore.keys import ROOT, chunk_key, tokens_to_bytes

    tb = tokens_to_bytes(range(256))
    h = make_header(
        key=chunk_key(ROOT, FP, tb),
        parent=ROOT,
        fingerprint=FP,
        token_bytes=tb,
        dtype="bfloat16",
        shape=(256, 8, 128),
        payload=raw,
    )
    z = len(transcode(build(h, raw), Codec.ZSTD))
    zs = len(transcode(build(h, raw), Codec.ZSTD_SHUFFLE))
    assert zs < z, f"byte-shuffle should help on bf16: zstd {z} vs zstd_shuffle {zs}"


@pytest.mark.parametrize("codec", list(Codec))
def test_every_flipped_bit_region_is_caught(codec: Codec) -> None:
    header, payload = make_chunk(range(64))
    blob = bytearray(transcode(build(header, payload), codec))
    rng = np.random.default_rng(1)
    for pos in [
        0,
        5,
        20,
        60,
        100,
        150,
        190,
        header.header_size - 70,
        header.header_size + 3,
        len(blob) - 1,
        *rng.integers(0, len(blob), 20),
    ]:
        damaged = bytearray(blob)
        damaged[int(pos)] ^= 0x10
        with pytest.raises(CorruptRecord):
            h = verify(bytes(damaged))
            # A flip in the padding after the token ids is harmless: not covered, not read.
            if h.header_size - 1 >= pos >= 200 + 4 * h.n_tokens:
                raise CorruptRecord("padding")


def test_truncated_and_wrong_key() -> None:
    header, payload = make_chunk(range(64))
    blob = build(header, payload)
    with pytest.raises(CorruptRecord):
        verify(blob[:-1])
    with pytest.raises(CorruptRecord):
        verify(blob[:10])
    with pytest.raises(CorruptRecord):
        verify(blob + b"x")
    with pytest.raises(CorruptRecord, match="not its own"):
        verify(blob, expect_key=b"\x01" * 32)
    assert parse_header(blob).key == header.key


def test_bad_fields_rejected_at_construction() -> None:
    header, payload = make_chunk(range(8))
    common = dict(
        key=header.key, parent=header.parent, fingerprint=FP, token_bytes=header.token_bytes
    )
    with pytest.raises(InvalidArgument, match="needs"):
        make_header(**common, dtype="bfloat16", shape=(8, 33), payload=payload)
    with pytest.raises(InvalidArgument, match="unsupported dtype"):
        make_header(**common, dtype="complex64", shape=(8, 32), payload=payload)
    with pytest.raises(InvalidArgument, match="positive"):
        make_header(**common, dtype="bfloat16", shape=(0,), payload=b"")
    with pytest.raises(InvalidArgument):
        make_header(
            key=header.key,
            parent=header.parent,
            fingerprint=FP,
            token_bytes=b"",
            dtype="bfloat16",
            shape=(8, 32),
            payload=payload,
        )
    with pytest.raises(InvalidArgument, match="allowed"):
        Codec.parse("lz4")


def test_a_header_sealed_with_its_checksum_is_the_same_header_but_for_it() -> None:
    """``with_checksum`` (the commit's seal) builds the header without the dataclass's
    ``__init__``: it must equal what ``dataclasses.replace`` gives, sizes included, and
    leave the header it came from alone."""
    from dataclasses import replace

    header, payload = make_chunk(range(7, 71))
    placeholder = replace(header, payload_checksum=0)
    sealed = placeholder.with_checksum(header.payload_checksum)
    assert sealed == header and sealed is not placeholder
    assert placeholder.payload_checksum == 0, "the header it came from changed"
    assert (sealed.header_size, sealed.record_size, sealed.n_tokens) == (
        header.header_size,
        header.record_size,
        header.n_tokens,
    )
    assert sealed.pack() == header.pack()
    assert verify(sealed.pack() + payload, expect_key=header.key) == header
