"""kvstore.accel: the native loops give the same answers as their Python twins, and
both give what hashlib and xxhash give.

Every native function is run with each implementation the CPU can pick (SHA-NI and
portable C for SHA-256; the one-pass AVX2 copy and the block copy), over the
lengths where the algorithms change path (SHA-256 padding at 55/56/64 bytes; XXH3
at 16/128/240 bytes and at its 1 KiB blocks) and at misaligned addresses.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import accel

native = pytest.mark.skipif(not accel.NATIVE, reason="kvstore._native is not built here")

LENGTHS = sorted(
    {
        *range(0, 300),
        511,
        512,
        513,
        1023,
        1024,
        1025,
        1087,
        1088,
        1089,
        4095,
        4096,
        4097,
        16383,
        16384,
        16385,
        65536 + 7,
        (1 << 20) + 63,
    }
)


def test_native_is_built() -> None:
    """CI builds the extension (setup.sh installs with a C compiler); without it kvstore
    still works, at a fraction of the speed: this says so rather than passing."""
    if os.environ.get("KVSTORE_PURE_PYTHON", "") not in ("", "0"):
        assert not accel.NATIVE and accel.IMPL == "python"
        return
    assert accel.NATIVE, (
        "kvstore._native was not built: install a C compiler and the Python headers "
        "(apt install gcc python3-dev), then `pip install -e .` again"
    )
    assert accel.IMPL.startswith("native")


@pytest.fixture(params=["best", "portable"])
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each native implementation in turn (restored to the best one after)."""
    if not accel.NATIVE:
        pytest.skip("kvstore._native is not built here")
    n = accel._native
    generic = request.param == "portable"
    n.sha256_select(generic)
    n.copies_select(generic)
    try:
        yield f"{n.sha256_impl()}/{n.copies_impl()}"
    finally:
        n.sha256_select(False)
        n.copies_select(False)


def test_sha256_matches_hashlib(impl: str) -> None:
    data = os.urandom(max(LENGTHS))
    for n in LENGTHS:
        assert accel._native.sha256(data[:n]) == hashlib.sha256(data[:n]).digest(), (impl, n)


def test_chain_keys_match_the_python_twin(impl: str) -> None:
    prefix = b"kvstore-chunk-v2".ljust(64, b"\0") + os.urandom(16)
    data = os.urandom(4 * 1000)
    for parent in (bytes(32), os.urandom(32)):
        for step in (4, 64, 1024, 1088):
            want = accel._py_chain_keys(prefix, parent, data, step)
            assert accel._native.chain_keys(prefix, parent, data, step) == want, (impl, step)
    assert accel._native.chain_keys(prefix, bytes(32), b"", 64) == []


def test_chain_probe_stops_at_the_first_missing_key(impl: str) -> None:
    class Entry:
        def __init__(self, tiers: int) -> None:
            self.tiers = tiers

    prefix = os.urandom(80)
    data = os.urandom(4 * 256 * 6)
    keys = accel._py_chain_keys(prefix, bytes(32), data, 1024)
    for stored in (0, 1, 3, 6):
        mapping = {k: Entry(i + 2) for i, k in enumerate(keys[:stored])}
        mapping[os.urandom(32)] = Entry(0)  # a key of another prompt: never found
        got = accel._native.chain_probe(prefix, bytes(32), data, 1024, mapping, "tiers")
        want = accel._py_chain_probe(prefix, bytes(32), data, 1024, mapping, "tiers")
        assert got == want, (impl, stored)
        assert got[0] == keys[:stored] and got[1] == list(range(2, stored + 2))
        assert got[2] == (keys[stored] if stored < len(keys) else None)
    with pytest.raises(AttributeError):
        accel._native.chain_probe(prefix, bytes(32), data, 1024, {keys[0]: object()}, "tiers")


def _fresh(b: bytes) -> bytes:
    """Equal bytes in an object of their own (a literal is one shared object)."""
    return bytes(bytearray(b))


def test_probe_keys_stops_at_the_first_key_missing_or_of_another_owner() -> None:
    class Entry:
        def __init__(self, tiers: int, owner: bytes) -> None:
            self.tiers, self.fingerprint = tiers, owner

    probes = [accel._py_probe_keys] + ([accel._native.probe_keys] if accel.NATIVE else [])
    keys = [os.urandom(32) for _ in range(6)]
    blob = b"".join(keys)
    for held in (0, 1, 3, 6):
        for foreign in (None, *range(held)):
            # Owners equal but not the same objects: the probe compares their bytes.
            mapping = {k: Entry(i + 2, _fresh(b"mine")) for i, k in enumerate(keys[:held])}
            if foreign is not None:  # a key held, but for another namespace: a stop
                mapping[keys[foreign]] = Entry(9, _fresh(b"mind"))
            stop = held if foreign is None else foreign
            for probe in probes:
                got = probe(blob, mapping, "tiers", "fingerprint", _fresh(b"mine"))
                assert got == (list(range(2, stop + 2)), keys[stop] if stop < 6 else None), (
                    probe,
                    held,
                    foreign,
                )
    for probe in probes:
        with pytest.raises(ValueError, match="32 bytes"):
            probe(blob[:40], {}, "tiers", "fingerprint", b"mine")
        with pytest.raises(AttributeError):
            probe(blob, {keys[0]: object()}, "tiers", "fingerprint", b"mine")
        with pytest.raises(AttributeError):  # a None entry is an entry, not a miss
            probe(blob, {keys[0]: None}, "tiers", "fingerprint", b"mine")


def test_prefix_digests_match_the_python_twin(impl: str) -> None:
    prefix = b"kvstore-sub-v2".ljust(64, b"\0")
    data = os.urandom(4 * 300)
    for unit in (4, 60, 64, 100, 1200, 2000):
        for size in (1, 8, 32):
            got = accel._native.prefix_digests(prefix, data, unit, size)
            assert got == accel._py_prefix_digests(prefix, data, unit, size), (impl, unit)
            assert len(got) == len(data) // unit * size


def _buffers(n: int, src_off: int, dst_off: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.frombuffer(os.urandom(n + 64), np.uint8)[src_off : src_off + n]
    dst = np.zeros(n + 64, np.uint8)[dst_off : dst_off + n]
    return src, dst


def test_copy_xxh3_is_a_copy_and_its_hash(impl: str) -> None:
    for n in LENGTHS:
        for src_off, dst_off in ((0, 0), (1, 3), (33, 16)):
            src, dst = _buffers(n, src_off, dst_off)
            got = accel._native.copy_xxh3(dst, src)
            assert got == xxhash.xxh3_64_intdigest(src), (impl, n, src_off, dst_off)
            assert np.array_equal(dst, src), (impl, n, src_off, dst_off)


def test_copy_copies_at_every_length_and_alignment(impl: str) -> None:
    for n in LENGTHS:
        for src_off, dst_off in ((0, 0), (0, 16), (5, 2055 % 64)):
            src, dst = _buffers(n, src_off, dst_off)
            assert accel._native.copy(dst, src) is None
            assert np.array_equal(dst, src), (impl, n, src_off, dst_off)
    with pytest.raises(ValueError):
        accel._native.copy(np.zeros(3, np.uint8), b"ab")


def test_scatter_xxh3_over_several_spans(impl: str) -> None:
    arena = np.zeros(1 << 20, np.uint8)
    payload = np.frombuffer(os.urandom(300_001), np.uint8)
    spans = [(4096, 0, 100_000), (500_003, 100_000, 1), (200_000, 100_001, 200_000)]
    h = accel._native.scatter_xxh3(arena, payload, spans, True)
    assert h == xxhash.xxh3_64_intdigest(payload), impl
    for off, pos, n in spans:
        assert np.array_equal(arena[off : off + n], payload[pos : pos + n])
    out = np.zeros_like(payload)
    assert accel._native.scatter_xxh3(arena, out, spans, False) == h
    assert np.array_equal(out, payload)
    assert accel._py_scatter_xxh3(arena, out, spans, False) == h


def test_scatter_xxh3_is_the_hash_however_the_pieces_fall(impl: str) -> None:
    """The fused pass over many pieces (stripes split across pieces, the last stripe
    held back, a short stream, non-temporal stores into aligned pieces of 4 KiB and
    more, unaligned ones) gives XXH3_64bits of the bytes in span order, and copies
    them, both ways: for every total around XXH3's edges (240 bytes, 64-byte stripes,
    1 KiB blocks) and pieces cut at random, aligned or not."""
    rng = np.random.default_rng(12)
    totals = [0, 1, 63, 64, 65, 239, 240, 241, 255, 256, 1023, 1024, 1025, 1088, 2048,
              2049, 4096, 16_384 + 64, 100_003, 300_000]  # fmt: skip
    for total in totals:
        payload = np.frombuffer(os.urandom(total), np.uint8)
        for cut in ("one", "random", "stripes", "pages"):
            if cut == "one":
                sizes = [total]
            elif cut == "random":
                sizes = list(np.diff([0, *sorted(rng.integers(0, total + 1, 7)), total]))
            elif cut == "stripes":  # pieces of 4096 and 64 bytes: aligned, streamed
                sizes, left = [], total
                while left:
                    sizes.append(min(64 if len(sizes) % 2 else 4096, left))
                    left -= sizes[-1]
            else:
                sizes = [min(8192, total - j) for j in range(0, total, 8192)]
            arena = np.zeros(2 * total + 64 * len(sizes) + 4096, np.uint8)
            spans, pos, at = [], 0, 32 if cut == "random" else 0  # misaligned, or not
            for n in reversed(sizes):  # pieces land in reverse order, as blocks may
                spans.append((at, pos, int(n)))
                pos += int(n)
                at += int(n) + (64 if cut != "random" else 7)
            spans.reverse()
            # the payload's bytes in span order
            order = np.concatenate([payload[p : p + n] for _, p, n in spans] or [payload[:0]])
            want = xxhash.xxh3_64_intdigest(order.tobytes())
            h = accel._native.scatter_xxh3(arena, payload, spans, True)
            assert h == want, (impl, total, cut)
            for off, p, n in spans:
                assert np.array_equal(arena[off : off + n], payload[p : p + n]), (total, cut)
            out = np.zeros_like(payload)
            assert accel._native.scatter_xxh3(arena, out, spans, False) == want, (total, cut)
            assert np.array_equal(out, payload), (impl, total, cut)


def test_streams_hash_each_payload_across_calls(impl: str) -> None:
    """Several payloads, each cut into parts copied over several scatter_streams calls
    interleaved with the others' (one layer of every chunk per call): each stream's
    digest is its payload's xxh3_64, whatever the cuts (inside a stripe, at XXH3's
    240-byte edge, at block ends), and every byte lands where its span says."""
    rng = random.Random(7)
    for sizes in ([1, 239, 240, 241, 1024], [64 * 1024 + 7, 300_001, 128, 16 * 1024 * 3]):
        payloads = [np.frombuffer(os.urandom(n), np.uint8) for n in sizes]
        parts = 3
        cuts = [sorted(rng.randrange(n + 1) for _ in range(parts - 1)) for n in sizes]
        src = np.concatenate(payloads)
        starts = np.cumsum([0, *sizes[:-1]])
        dst = np.zeros(src.size + 4096, np.uint8)
        streams = accel._native.Streams(len(sizes))
        twin = accel._PyStreams(len(sizes))
        out2 = np.zeros_like(dst)
        for part in range(parts):
            spans = []
            for k, n in enumerate(sizes):
                edges = [0, *cuts[k], n]
                a, b = edges[part], edges[part + 1]
                # Each part in two pieces, written to the destination out of order.
                mid = (a + b) // 2
                spans += [
                    (int(starts[k]) + mid, 4096 + int(starts[k]) + mid, b - mid, k),
                    (int(starts[k]) + a, 4096 + int(starts[k]) + a, mid - a, k),
                ][::-1]
            accel._native.scatter_streams(streams, src, dst, spans)
            accel._py_scatter_streams(twin, src, out2, spans)
        for k, p in enumerate(payloads):
            want = xxhash.xxh3_64_intdigest(p)
            assert streams.digest(k) == want, (impl, sizes[k], cuts[k])
            assert streams.digest(k) == want  # the digest is kept, not taken twice
            assert twin.digest(k) == want
        assert np.array_equal(dst[4096:], src) and np.array_equal(out2[4096:], src)
        with pytest.raises(ValueError, match="not an open stream"):
            accel._native.scatter_streams(streams, src, dst, [(0, 4096, 1, 0)])
        with pytest.raises(ValueError, match="not an open stream"):
            accel._py_scatter_streams(twin, src, out2, [(0, 4096, 1, 0)])
    streams = accel._native.Streams(1)
    with pytest.raises(ValueError, match="outside"):
        accel._native.scatter_streams(streams, src, dst, [(src.size, 0, 1, 0)])
    with pytest.raises(ValueError, match="not an open stream"):
        accel._native.scatter_streams(streams, src, dst, [(0, 0, 1, 1)])


def test_xxh3_2_is_the_hash_of_both_buffers() -> None:
    data = os.urandom(3000)
    twins = [accel._py_xxh3_2] + ([accel._native.xxh3_2] if accel.NATIVE else [])
    for cut in (0, 1, 200, 1024, 2999, 3000):
        for xxh3_2 in twins:
            assert xxh3_2(data[:cut], memoryview(data)[cut:]) == xxhash.xxh3_64_intdigest(data)


def test_u32le_matches_the_python_twin() -> None:
    twins = [accel._py_u32le] + ([accel._native.u32le] if accel.NATIVE else [])
    ids = [0, 1, 255, 256, 65535, 65536, 2**31, 2**32 - 1, *range(1000, 1100)]
    want = np.array(ids, dtype="<u4").tobytes()
    for u32le in twins:
        assert u32le(ids) == want and u32le(tuple(ids)) == want
        assert u32le([np.int64(7), np.uint32(8), True]) == np.array([7, 8, 1], "<u4").tobytes()
        assert u32le([]) == b""
        for bad in ([1, -1], [2**32], [10**30]):
            with pytest.raises(OverflowError):
                u32le(bad)
        with pytest.raises(TypeError):
            u32le([1, 1.5])


@native
def test_inputs_that_change_while_read_do_not_crash() -> None:
    """An id's __index__ may clear the list being converted, or shrink the spans being
    parsed: the native code must not read freed memory (it used to segfault)."""
    ids: list[object] = []

    class Clears:
        def __index__(self) -> int:
            ids.clear()
            return 1

    ids.extend([Clears(), *range(100_000)])
    with pytest.raises(RuntimeError, match="changed"):
        accel._native.u32le(ids)

    spans: list[tuple[object, int, int]] = []

    class Shrinks:
        def __index__(self) -> int:
            spans.clear()
            return 0

    spans.extend([(Shrinks(), 0, 8), *[(8 * i, 8 * i, 8) for i in range(1, 1000)]])
    arena, buf = np.zeros(8000, np.uint8), np.frombuffer(os.urandom(8000), np.uint8)
    assert accel._native.scatter_xxh3(arena, buf, spans, True) == xxhash.xxh3_64_intdigest(buf)


def test_overlapping_copies_behave_like_memmove(impl: str) -> None:
    for n in (100, 1000, 70_000):
        for shift in (-16, 16, 3):
            mem = np.frombuffer(bytearray(os.urandom(n + 64)), np.uint8)
            want = mem.copy()
            a, b = 32, 32 + shift
            want[b : b + n] = want[a : a + n].copy()
            twin = mem.copy()
            accel._py_copy(twin[b : b + n], twin[a : a + n])
            got = mem.copy()
            accel._native.copy(got[b : b + n], got[a : a + n])
            assert np.array_equal(got, want) and np.array_equal(twin, want), (impl, n, shift)
            got = mem.copy()
            h = accel._native.copy_xxh3(got[b : b + n], got[a : a + n])
            assert np.array_equal(got, want) and h == xxhash.xxh3_64_intdigest(want[b : b + n])
    arena = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="overlaps"):
        accel._native.scatter_xxh3(arena, arena[50:], [(40, 0, 20)], True)


def test_bad_arguments_raise() -> None:
    arena, buf = np.zeros(100, np.uint8), np.zeros(10, np.uint8)
    fns = [accel._py_scatter_xxh3] + ([accel._native.scatter_xxh3] if accel.NATIVE else [])
    for fn in fns:
        for span in ((95, 0, 10), (0, 5, 10), (-1, 0, 1)):
            with pytest.raises(ValueError, match="outside"):
                fn(arena, buf, [span], True)
    copies = [accel._py_copy_xxh3, accel._py_copy]
    copies += [accel._native.copy_xxh3, accel._native.copy] if accel.NATIVE else []
    for copy in copies:
        with pytest.raises(ValueError):
            copy(np.zeros(3, np.uint8), b"ab")
        with pytest.raises((TypeError, ValueError)):
            copy(b"abc", b"abc")  # a read-only destination
    if accel.NATIVE:
        with pytest.raises(ValueError, match="read-only"):
            accel._native.scatter_xxh3(arena, b"0123456789", [(0, 0, 10)], False)
        with pytest.raises(ValueError):
            accel._native.chain_keys(b"", b"short", b"1234", 4)


@native
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=5000), src_off=st.integers(0, 63), dst_off=st.integers(0, 63))
def test_copy_xxh3_property(data: bytes, src_off: int, dst_off: int) -> None:
    src = np.frombuffer(bytes(src_off) + data, np.uint8)[src_off:]
    dst = np.zeros(len(data) + dst_off, np.uint8)[dst_off:]
    assert accel._native.copy_xxh3(dst, src) == xxhash.xxh3_64_intdigest(data)
    assert dst.tobytes() == data
