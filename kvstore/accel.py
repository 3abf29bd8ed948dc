"""The loops kvstore runs per chunk and per byte: native when it can, Python when not.

``kvstore._native`` (C, in ``kvstore/csrc/``) is built by ``pip install`` where a C
compiler and the Python headers are present; the build is optional, and without it
every function here falls back to a pure-Python twin that gives the same answer
(``tests/test_accel.py`` runs both against each other and against hashlib/xxhash).
``IMPL`` says which is in use; ``kvstore info``, the server's ``Info`` and the
benchmarks report it. ``KVSTORE_PURE_PYTHON=1`` forces the Python twins.

What the native module buys (docs/performance.md has the figures):

- ``chain_probe``/``chain_keys``: a 128k-token lookup hashes 512 chained ~1 KiB
  messages. hashlib spends more per call than the SHA instructions spend on the
  bytes; one C loop does the chain and the dict probes with no Python call per chunk.
  ``probe_keys`` is the probe alone, for the keys a client hashed (half the Python loop).
- ``copy_xxh3``/``scatter_xxh3``: a verified copy. With AVX2 each 64-byte stripe is
  loaded once, stored, and fed to XXH3 from the same registers: one pass over the
  bytes instead of a copy and a hash pass. What is hashed is exactly what was stored.
- ``Streams``/``scatter_streams``: the same for payloads that arrive in parts over
  several calls (a KV cache loaded one layer at a time), one hash stream each.
"""

from __future__ import annotations

import array
import errno
import hashlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import xxhash

Spans = Sequence[tuple[int, int, int]]
"""(arena offset, buffer offset, length) triples, in record order."""

StreamSpans = Sequence[tuple[int, int, int, int]]
"""(source offset, destination offset, length, stream) tuples (``scatter_streams``)."""

_native: Any = None
if os.environ.get("KVSTORE_PURE_PYTHON", "") in ("", "0"):
    try:
        _native = importlib.import_module("kvstore._native")
    except ImportError:  # not built here (no compiler at install time)
        _native = None

NATIVE = _native is not None
IMPL = (
    f"native (sha256 {_native.sha256_impl()}, copies {_native.copies_impl()})"
    if NATIVE
    else "python"
)


# -- pure-Python twins ---------------------------------------------------------------
def _py_chain(prefix: bytes, parent: bytes, data: Any, step: int) -> Iterator[bytes]:
    """The chained keys, one at a time (chain_probe stops early)."""
    view = memoryview(data).cast("B")
    copy = hashlib.sha256(prefix).copy
    for s in range(0, len(view), step):
        h = copy()
        h.update(parent)
        h.update(view[s : s + step])
        parent = h.digest()
        yield parent


def _py_chain_keys(prefix: bytes, parent: bytes, data: Any, step: int) -> list[bytes]:
    return list(_py_chain(prefix, parent, data, step))


def _py_chain_probe(
    prefix: bytes, parent: bytes, data: Any, step: int, mapping: dict[bytes, Any], attr: str
) -> tuple[list[bytes], list[Any], bytes | None]:
    get = mapping.get
    keys: list[bytes] = []
    values: list[Any] = []
    for key in _py_chain(prefix, parent, data, step):
        value = get(key)
        if value is None:
            return keys, values, key
        keys.append(key)
        values.append(getattr(value, attr))
    return keys, values, None


_ABSENT = object()


def _py_probe_keys(
    keys: bytes, mapping: dict[bytes, Any], attr: str, owner_attr: str, owner: object
) -> tuple[list[Any], bytes | None]:
    if len(keys) % 32:
        raise ValueError("keys must be 32 bytes each")
    values: list[Any] = []
    for s in range(0, len(keys), 32):
        key = keys[s : s + 32]
        value = mapping.get(key, _ABSENT)
        if value is _ABSENT or getattr(value, owner_attr) != owner:
            return values, key
        values.append(getattr(value, attr))
    return values, None


def _py_prefix_digests(prefix: bytes, data: Any, unit: int, size: int) -> bytes:
    view = memoryview(data).cast("B")
    h = hashlib.sha256(prefix)
    update, digest = h.update, h.digest  # digest() leaves the running state as it was
    out = []
    for off in range(0, len(view) - unit + 1, unit):
        update(view[off : off + unit])
        out.append(digest()[:size])
    return b"".join(out)


def _py_xxh3_2(a: Any, b: Any) -> int:
    h = xxhash.xxh3_64(a)
    h.update(b)
    return h.intdigest()


def _py_u32le(ids: Any) -> bytes:
    arr = array.array("I", ids)  # C unsigned int: 32 bits wherever kvstore runs
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _py_advise(address: int, size: int, advice: int, piece: int) -> int:
    import ctypes

    if size < 0 or piece <= 0:
        raise ValueError("size must be >= 0 and piece > 0")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):  # no C library to ask, or no madvise in it
        return errno.ENOSYS
    for off in range(0, size, piece):
        if libc.madvise(address + off, min(piece, size - off), advice) != 0:
            return ctypes.get_errno()
    return 0


def _py_copy(dst: Any, src: Any) -> None:
    d, s = memoryview(dst).cast("B"), memoryview(src).cast("B")
    if len(d) != len(s):
        raise ValueError(f"dst is {len(d)} bytes, src {len(s)}")
    d[:] = s


def _py_copy_xxh3(dst: Any, src: Any) -> int:
    d, s = memoryview(dst).cast("B"), memoryview(src).cast("B")
    if len(d) != len(s):
        raise ValueError(f"dst is {len(d)} bytes, src {len(s)}")
    d[:] = s
    return xxhash.xxh3_64_intdigest(d)


def _py_scatter_xxh3(
    arena: Any, buf: Any, spans: Spans, into_arena: bool, piece: int = 512 << 10
) -> int:
    a, b = memoryview(arena).cast("B"), memoryview(buf).cast("B")
    h = xxhash.xxh3_64()
    for off, pos, n in spans:
        if off < 0 or pos < 0 or n < 0 or off + n > len(a) or pos + n > len(b):
            raise ValueError(f"span ({off}, {pos}, {n}) is outside the buffers")
        for o in range(0, n, piece):  # hash each piece right after it lands, in cache
            m = min(piece, n - o)
            mine, theirs = a[off + o : off + o + m], b[pos + o : pos + o + m]
            landed, source = (mine, theirs) if into_arena else (theirs, mine)
            landed[:] = source
            h.update(landed)
    return h.intdigest()


class _PyStreams:
    """The Python twin of ``_native.Streams``."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError("n < 0")
        self._h = [xxhash.xxh3_64() for _ in range(n)]
        self._ended: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._h)

    def digest(self, i: int) -> int:
        if not 0 <= i < len(self._h):
            raise IndexError("no such stream")
        return self._ended.setdefault(i, self._h[i].intdigest())


def _py_scatter_streams(streams: _PyStreams, src: Any, dst: Any, spans: StreamSpans) -> None:
    a, b = memoryview(src).cast("B"), memoryview(dst).cast("B")
    todo = list(spans)
    for off, pos, n, k in todo:  # checked first, as natively: nothing copied on a bad span
        if off < 0 or pos < 0 or n < 0 or off + n > len(a) or pos + n > len(b):
            raise ValueError(f"span ({off}, {pos}, {n}) is outside the buffers")
        if not 0 <= k < len(streams._h) or k in streams._ended:
            raise ValueError(f"stream {k} is not an open stream of these")
    for off, pos, n, k in todo:
        b[pos : pos + n] = a[off : off + n]
        streams._h[k].update(b[pos : pos + n])


chain_keys: Callable[[bytes, bytes, Any, int], list[bytes]]
"""chain_keys(prefix, parent, data, step): keys of data's step-byte chunks (the last
may be shorter), key = SHA-256(prefix || previous key || chunk), the first chained
on ``parent``."""

chain_probe: Callable[
    [bytes, bytes, Any, int, dict[Any, Any], str], tuple[list[bytes], list[Any], bytes | None]
]
"""chain_probe(prefix, parent, data, step, mapping, attr): as chain_keys, stopping at
the first key not in ``mapping``: (keys found, getattr(value, attr) of each, the
missing key or None)."""

probe_keys: Callable[[bytes, dict[Any, Any], str, str, object], tuple[list[Any], bytes | None]]
"""probe_keys(keys, mapping, attr, owner_attr, owner): ``keys`` (32 bytes each,
concatenated) walked until the first not in ``mapping`` or whose value's ``owner_attr``
is not ``owner``: (getattr(value, attr) of each key before it, that key or None)."""

prefix_digests: Callable[[bytes, Any, int, int], bytes]
"""prefix_digests(prefix, data, unit, size): for each whole ``unit`` bytes, the first
``size`` bytes of SHA-256(prefix || data up to the end of that unit)."""

xxh3_2: Callable[[Any, Any], int]
"""xxh3_2(a, b): the xxh3_64 of a followed by b, in one call."""

u32le: Callable[[Any], bytes]
"""u32le(ids): a list or tuple of ints as little-endian u32 bytes (OverflowError for an
id outside [0, 2**32), TypeError for one that is not an integer). Natively ~5x faster
than array("I", ids): vLLM hands prompts over as lists."""

advise: Callable[[int, int, int, int], int]
"""advise(address, size, advice, piece): madvise ``size`` bytes from ``address`` one
``piece`` at a time (the process's mapping lock is held for one piece at most); 0, or
the errno of the first piece refused. Natively the GIL is let go for the whole loop; the
twin's ctypes calls take it back after every piece."""

copy: Callable[[Any, Any], None]
"""copy(dst, src): copy src into dst (same length in bytes; overlapping buffers are
copied as memmove would). Natively a vector loop,
not memcpy: glibc's "rep movsb" runs ~8x slower on AMD Zen for some relative
alignments of the two buffers (kvstore/csrc/copies.c)."""

copy_xxh3: Callable[[Any, Any], int]
"""copy_xxh3(dst, src): copy src into dst (same length; overlapping as memmove); the
xxh3_64 of dst after."""

scatter_xxh3: Callable[[Any, Any, Spans, bool], int]
"""scatter_xxh3(arena, buf, spans, into_arena): copy between buf and the arena along
``spans`` (into the arena or out of it); the xxh3_64 of the bytes where they landed."""

Streams: Callable[[int], Any]
"""Streams(n): n xxh3_64 streams, one per payload whose bytes arrive over several
``scatter_streams`` calls; ``digest(i)`` ends stream i and returns its hash. One thread
at a time."""

scatter_streams: Callable[[Any, Any, Any, StreamSpans], None]
"""scatter_streams(streams, src, dst, spans): copy src into dst along ``spans``, each
span's bytes hashed, where they landed, onto the end of its stream (in span order)."""

if NATIVE:
    Streams = _native.Streams
    scatter_streams = _native.scatter_streams
    chain_keys = _native.chain_keys
    chain_probe = _native.chain_probe
    probe_keys = _native.probe_keys
    prefix_digests = _native.prefix_digests
    copy = _native.copy
    advise = _native.advise
    u32le = _native.u32le
    xxh3_2 = _native.xxh3_2
    copy_xxh3 = _native.copy_xxh3
    scatter_xxh3 = _native.scatter_xxh3
else:
    Streams = _PyStreams
    scatter_streams = _py_scatter_streams
    chain_keys = _py_chain_keys
    chain_probe = _py_chain_probe
    probe_keys = _py_probe_keys
    prefix_digests = _py_prefix_digests
    copy = _py_copy
    advise = _py_advise
    u32le = _py_u32le
    xxh3_2 = _py_xxh3_2
    copy_xxh3 = _py_copy_xxh3
    scatter_xxh3 = _py_scatter_xxh3
