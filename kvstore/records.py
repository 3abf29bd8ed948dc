"""Chunk records: one self-describing, self-verifying value per chunk.

A record is a fixed header, the chunk's token ids, padding to 64 bytes (so the
payload can be viewed as a tensor in place) and the payload. Every field a
reader trusts is covered by a checksum: the header checksum covers the header
and the token ids, the payload checksum covers the stored payload. A record
that fails either is a miss: ``CorruptRecord`` is raised here and the tiers turn
it into a counted, deleted miss. The byte layout is in docs/records.md.
"""

from __future__ import annotations

import enum
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from math import prod

import numpy as np
import xxhash
import zstandard

from kvstore import accel
from kvstore.errors import ChunkTooLarge, CorruptRecord, InvalidArgument
from kvstore.keys import (
    FINGERPRINT_BYTES,
    KEY_BYTES,
    ChunkKey,
    Fingerprint,
    bytes_to_tokens,
    chunk_key,
)

MAGIC = b"KVS1"
FORMAT_VERSION = 1
MAX_DIMS = 8
ALIGN = 64

# magic, version, codec, dtype, n_tokens, ndim, 3 pad, key, parent, fingerprint,
# shape[8], raw_size, stored_size, payload_checksum, created_ms
_FIXED = struct.Struct(f"<4sHBBIB3x{KEY_BYTES}s{KEY_BYTES}s{FINGERPRINT_BYTES}s8QQQQQ")
_CHECK = struct.Struct("<Q")
FIXED_BYTES = _FIXED.size + _CHECK.size  # header checksum follows the fixed part


class Codec(enum.IntEnum):
    """How the payload is stored. L1 always holds RAW so readers can map it in place."""

    RAW = 0
    ZSTD = 1
    ZSTD_SHUFFLE = 2  # byte planes first: exponent bytes of bf16 compress, mantissas do not

    @classmethod
    def parse(cls, name: str) -> Codec:
        try:
            return cls[name.upper().replace("-", "_").replace("+", "_")]
        except KeyError:
            allowed = ", ".join(c.name.lower() for c in cls)
            raise InvalidArgument(f"unknown codec {name!r}; allowed: {allowed}") from None


# name -> (code, itemsize). Codes are part of the on-disk format: only append.
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (1, 1),
    "int8": (2, 1),
    "float16": (3, 2),
    "bfloat16": (4, 2),
    "float32": (5, 4),
    "float64": (6, 8),
    "int16": (7, 2),
    "int32": (8, 4),
    "int64": (9, 8),
    "float8_e4m3fn": (10, 1),
    "float8_e5m2": (11, 1),
}
_DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}
_CODECS = tuple(Codec)  # by value: Codec(n) is an enum call, ~0.5 us on every header read
assert all(c.value == i for i, c in enumerate(_CODECS))
_PAD = bytes(ALIGN)
_xxh3_int = xxhash.xxh3_64_intdigest


def dtype_itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype][1]
    except KeyError:
        raise InvalidArgument(
            f"unsupported dtype {dtype!r}; allowed: {', '.join(DTYPES)}"
        ) from None


def header_size(n_tokens: int) -> int:
    return -(-(FIXED_BYTES + 4 * n_tokens) // ALIGN) * ALIGN


@dataclass(frozen=True)
class RecordHeader:
    """What a record says about itself; every field is covered by the header checksum.

    The derived sizes are computed once per header (``cached_property`` keeps them in
    the instance ``__dict__``, next to the frozen fields): the hot paths read them often.
    """

    key: ChunkKey
    parent: ChunkKey
    fingerprint: Fingerprint
    token_bytes: bytes  # the chunk's token ids, u32le
    dtype: str
    shape: tuple[int, ...]
    codec: Codec
    raw_size: int  # payload bytes once decoded: prod(shape) * itemsize
    stored_size: int  # payload bytes as stored (compressed size for zstd)
    payload_checksum: int  # xxh3_64 of the stored payload
    created_ms: int

    @cached_property
    def n_tokens(self) -> int:
        return len(self.token_bytes) // 4

    @property
    def tokens(self) -> np.ndarray:
        return bytes_to_tokens(self.token_bytes)

    @cached_property
    def header_size(self) -> int:
        return header_size(len(self.token_bytes) // 4)

    @cached_property
    def record_size(self) -> int:
        return self.header_size + self.stored_size

    def with_checksum(self, payload_checksum: int) -> RecordHeader:
        """This header with another payload checksum (sealed at commit): the fields and
        derived sizes copied as they are, as ``_header`` builds one (``dataclasses.replace``
        runs the frozen ``__init__``: 5 us against 0.5, on every commit it seals)."""
        fields_ = dict(self.__dict__)
        fields_["payload_checksum"] = int(payload_checksum)
        h = _new(RecordHeader)
        _set(h, "__dict__", fields_)
        return h

    def pack(self) -> bytes:
        shape, tb = self.shape, self.token_bytes
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            self.codec,
            DTYPES[self.dtype][0],
            len(tb) // 4,
            len(shape),
            self.key,
            self.parent,
            self.fingerprint,
            *shape,
            *_NO_DIMS[len(shape) :],
            self.raw_size,
            self.stored_size,
            self.payload_checksum,
            self.created_ms,
        )
        pad = self.header_size - FIXED_BYTES - len(tb)
        return b"".join((fixed, _CHECK.pack(accel.xxh3_2(fixed, tb)), tb, _PAD[:pad]))


_NO_DIMS = (0,) * MAX_DIMS
_new = object.__new__
_set = object.__setattr__


def _header(
    key: bytes,
    parent: bytes,
    fingerprint: bytes,
    token_bytes: bytes,
    dtype: str,
    shape: tuple[int, ...],
    codec: Codec,
    raw_size: int,
    stored_size: int,
    payload_checksum: int,
    created_ms: int,
) -> RecordHeader:
    """A RecordHeader from already validated fields, without the frozen dataclass
    ``__init__`` (one ``object.__setattr__`` per field: ~2 us, paid on every record read).

    The derived sizes go in too: a ``cached_property``'s first read runs Python code
    under a lock (~1-2 us each), and every read path asks for them.
    """
    n_tokens = len(token_bytes) // 4
    hs = -(-(FIXED_BYTES + 4 * n_tokens) // ALIGN) * ALIGN  # header_size(n_tokens)
    h = _new(RecordHeader)
    _set(
        h,
        "__dict__",
        {
            "key": key,
            "parent": parent,
            "fingerprint": fingerprint,
            "token_bytes": token_bytes,
            "dtype": dtype,
            "shape": shape,
            "codec": codec,
            "raw_size": raw_size,
            "stored_size": stored_size,
            "payload_checksum": payload_checksum,
            "created_ms": created_ms,
            "n_tokens": n_tokens,
            "header_size": hs,
            "record_size": hs + stored_size,
        },
    )
    return h


_FIELDS = [f.name for f in fields(RecordHeader)]
_SAMPLE = _header(b"", b"", b"", b"", "", (), Codec.RAW, 0, 0, 0, 0)
assert list(_SAMPLE.__dict__)[: len(_FIELDS)] == _FIELDS, (
    "_header must set exactly the fields of RecordHeader, first"
)


def make_header(
    *,
    key: ChunkKey,
    parent: ChunkKey,
    fingerprint: Fingerprint,
    token_bytes: bytes,
    dtype: str,
    shape: Sequence[int],
    payload: bytes | memoryview | None = None,
    codec: Codec = Codec.RAW,
    stored_size: int | None = None,
    payload_checksum: int | None = None,
    created_ms: int | None = None,
) -> RecordHeader:
    """Validate the fields of a RAW or encoded record and build its header.

    Give either ``payload`` (the stored bytes, checksummed here) or both
    ``stored_size`` and ``payload_checksum`` (a writer that streams the payload).
    """
    itemsize = dtype_itemsize(dtype)
    shape_t = tuple(int(d) for d in shape)
    if not 1 <= len(shape_t) <= MAX_DIMS or any(d <= 0 for d in shape_t):
        raise InvalidArgument(f"shape must have 1-{MAX_DIMS} positive dims, got {shape_t}")
    if len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
        raise InvalidArgument(f"keys are {KEY_BYTES} bytes")
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise InvalidArgument(f"namespace fingerprints are {FINGERPRINT_BYTES} bytes")
    if len(token_bytes) == 0 or len(token_bytes) % 4:
        raise InvalidArgument("a chunk holds at least one token (u32le token ids)")
    raw_size = prod(shape_t) * itemsize
    if payload is not None:
        stored_size = memoryview(payload).nbytes
        payload_checksum = _xxh3_int(payload)
    if stored_size is None or payload_checksum is None:
        raise InvalidArgument("give the payload, or its stored size and checksum")
    if codec == Codec.RAW and stored_size != raw_size:
        raise InvalidArgument(
            f"payload is {stored_size} bytes but dtype {dtype} x shape {shape_t} needs {raw_size}"
        )
    return _header(
        bytes(key),
        bytes(parent),
        bytes(fingerprint),
        bytes(token_bytes),
        dtype,
        shape_t,
        Codec(codec),
        raw_size,
        stored_size,
        int(payload_checksum),
        int(time.time() * 1000) if created_ms is None else int(created_ms),
    )


def parse_header(buf: bytes | memoryview, *, expect_key: bytes | None = None) -> RecordHeader:
    """Read and verify a header (not the payload). Raises CorruptRecord."""
    view = memoryview(buf)
    if len(view) < FIXED_BYTES:
        raise CorruptRecord(f"record of {len(view)} bytes is shorter than a header")
    # magic, version, codec, dtype, n_tokens, ndim, key, parent, fingerprint, shape[8],
    # raw_size, stored_size, payload_checksum, created_ms (indexed: no star-unpacking)
    f = _FIXED.unpack_from(view)
    if f[0] != MAGIC:
        raise CorruptRecord(f"bad magic {bytes(f[0])!r}")
    if f[1] != FORMAT_VERSION:
        raise CorruptRecord(f"record format {f[1]} is not {FORMAT_VERSION}")
    end = FIXED_BYTES + 4 * f[4]
    if len(view) < end:
        raise CorruptRecord("record truncated inside its token ids")
    token_bytes = view[FIXED_BYTES:end].tobytes()
    if accel.xxh3_2(view[: _FIXED.size], token_bytes) != _CHECK.unpack_from(view, _FIXED.size)[0]:
        raise CorruptRecord("header checksum mismatch")
    if expect_key is not None and f[6] != expect_key:
        raise CorruptRecord("record is stored under a key that is not its own")
    codec, dtype, ndim = f[2], _DTYPE_BY_CODE.get(f[3]), f[5]
    if dtype is None or codec >= len(_CODECS) or ndim > MAX_DIMS:
        raise CorruptRecord(f"header field out of range: codec {codec}, dtype {f[3]}, ndim {ndim}")
    return _header(
        f[6],
        f[7],
        f[8],
        token_bytes,
        dtype,
        f[9 : 9 + ndim],
        _CODECS[codec],
        f[17],
        f[18],
        f[19],
        f[20],
    )


def checksum(parts: Iterable[bytes | memoryview]) -> int:
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def verify(blob: bytes | memoryview, *, expect_key: bytes | None = None) -> RecordHeader:
    """Verify a whole record held in one buffer: header, length and payload checksum."""
    view = memoryview(blob)
    header = parse_header(view, expect_key=expect_key)
    if len(view) != header.record_size:
        raise CorruptRecord(f"record is {len(view)} bytes, its header says {header.record_size}")
    if _xxh3_int(view[header.header_size :]) != header.payload_checksum:
        raise CorruptRecord("payload checksum mismatch")
    return header


def _shuffle(data: bytes | memoryview, itemsize: int) -> bytes:
    if itemsize == 1:
        return bytes(data)
    arr = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(
        arr.size, dtype=np.uint8
    )  # assigning into a buffer is ~30x faster than .T.tobytes()
    out.reshape(itemsize, -1)[:] = arr.reshape(-1, itemsize).T
    return out.tobytes()


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    if itemsize == 1:
        return data
    arr = np.frombuffer(data, dtype=np.uint8)
    out = np.empty(arr.size, dtype=np.uint8)
    out.reshape(-1, itemsize)[:] = arr.reshape(itemsize, -1).T
    return out.tobytes()


def encode_payload(
    raw: bytes | memoryview, codec: Codec, itemsize: int, level: int = 1
) -> bytes | memoryview:
    if codec == Codec.RAW:
        return raw
    data = _shuffle(raw, itemsize) if codec == Codec.ZSTD_SHUFFLE else raw
    return zstandard.ZstdCompressor(level=level).compress(data)


def decode_payload(header: RecordHeader, stored: bytes | memoryview) -> bytes | memoryview:
    """The raw payload of a verified record."""
    if header.codec == Codec.RAW:
        return stored
    try:
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=header.raw_size)
    except zstandard.ZstdError as e:
        raise CorruptRecord(f"payload does not decompress: {e}") from e
    if len(data) != header.raw_size:
        raise CorruptRecord(f"payload decodes to {len(data)} bytes, header says {header.raw_size}")
    if header.codec == Codec.ZSTD_SHUFFLE:
        data = _unshuffle(data, DTYPES[header.dtype][1])
    return data


def build(header: RecordHeader, stored_payload: bytes | memoryview) -> bytes:
    return header.pack() + bytes(stored_payload)


def encode(
    *,
    key: ChunkKey,
    parent: ChunkKey,
    fingerprint: Fingerprint,
    token_bytes: bytes,
    dtype: str,
    shape: Sequence[int],
    payload: bytes | memoryview,
    codec: Codec = Codec.RAW,
    level: int = 1,
) -> bytes:
    """A complete record from a raw payload."""
    raw_header = make_header(
        key=key,
        parent=parent,
        fingerprint=fingerprint,
        token_bytes=token_bytes,
        dtype=dtype,
        shape=shape,
        payload=payload,
    )
    if codec == Codec.RAW:
        return build(raw_header, payload)
    return transcode_parts(raw_header, payload, codec, level)


def transcode_parts(
    header: RecordHeader, stored: bytes | memoryview, codec: Codec, level: int = 1
) -> bytes:
    """Re-encode a verified record's payload with another codec."""
    if header.codec == codec:
        return build(header, stored)
    raw = decode_payload(header, stored)
    out = encode_payload(raw, codec, DTYPES[header.dtype][1], level)
    new = make_header(
        key=header.key,
        parent=header.parent,
        fingerprint=header.fingerprint,
        token_bytes=header.token_bytes,
        dtype=header.dtype,
        shape=header.shape,
        payload=out,
        codec=codec,
        created_ms=header.created_ms,
    )
    return build(new, out)


def transcode(blob: bytes | memoryview, codec: Codec, level: int = 1) -> bytes:
    header = verify(blob)
    return transcode_parts(header, memoryview(blob)[header.header_size :], codec, level)


def check_put(
    header: RecordHeader,
    *,
    max_chunk_bytes: int | None = None,
    chunk_tokens: int | None = None,
    key: bool = False,
) -> None:
    """The one check of a header that is put (by the SDK before it sends, the server
    when one arrives, the store, L1): RAW, self-consistent, within the limits given.

    ``key``: also check that the key is hash(parent, namespace, tokens) (one SHA-256:
    the store does it, the client made the key that way). Raises InvalidArgument, or
    ChunkTooLarge (an InvalidArgument sent as RESOURCE_EXHAUSTED) past max_chunk_bytes.
    """
    if header.codec != Codec.RAW:
        raise InvalidArgument(
            f"puts carry RAW payloads (each tier chooses its own codec), got codec "
            f"{header.codec.name}"
        )
    if (
        not header.shape
        or header.raw_size != prod(header.shape) * DTYPES[header.dtype][1]
        or header.stored_size != header.raw_size
    ):
        raise InvalidArgument(
            f"header is inconsistent: {header.dtype} x {header.shape} is "
            f"not {header.raw_size} raw / {header.stored_size} stored bytes"
        )
    if max_chunk_bytes is not None and header.record_size > max_chunk_bytes:
        raise ChunkTooLarge(
            f"record of {header.record_size} bytes exceeds max_chunk_bytes={max_chunk_bytes}"
        )
    if chunk_tokens is not None and header.n_tokens > chunk_tokens:
        raise InvalidArgument(
            f"chunk holds {header.n_tokens} tokens; chunk_tokens is {chunk_tokens}"
        )
    if key and chunk_key(header.parent, header.fingerprint, header.token_bytes) != header.key:
        raise InvalidArgument("key does not match hash(parent, namespace, tokens)")
