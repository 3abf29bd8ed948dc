"""What a client makes of a chunk: its record header, the hashes a Lookup by keys carries,
and a Get stream's frames put back together (and verified) into a record.

These are pure functions of their arguments (no connection): ``ClientBase`` and the
connectors build on them, and tests use them to make the same headers a client would.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from math import prod
from typing import Any

import numpy as np
import xxhash

from kvstore import accel
from kvstore.arena import as_u8
from kvstore.errors import CorruptRecord, InvalidArgument, ServerError
from kvstore.keys import (
    FINGERPRINT_BYTES,
    ROOT,
    ChunkKey,
    Fingerprint,
    Namespace,
    chunk_key,
    chunk_prefix,
    sub_hashes,
)
from kvstore.keys import tokens_to_bytes as _tokens_to_bytes
from kvstore.protocol import unframe
from kvstore.records import RecordHeader, dtype_itemsize, make_header, parse_header
from kvstore.v1 import kvstore_pb2 as pb

NamespaceLike = Namespace | Fingerprint | bytes
Tokens = Sequence[int] | np.ndarray


def namespace_fingerprint(ns: NamespaceLike) -> tuple[Fingerprint, Namespace | None]:
    if isinstance(ns, Namespace):
        return ns.fingerprint, ns
    if isinstance(ns, (bytes, bytearray)) and len(ns) == FINGERPRINT_BYTES:
        return Fingerprint(bytes(ns)), None
    raise InvalidArgument(
        f"expected a kvstore.keys.Namespace or a {FINGERPRINT_BYTES}-byte "
        f"fingerprint, got {type(ns).__name__}"
    )


def chunk_header(
    ns: NamespaceLike,
    parent: ChunkKey,
    tokens: Tokens,
    payload: Any,
    dtype: str,
    shape: Sequence[int],
) -> RecordHeader:
    """The record header of one chunk (keys.chunk_key over parent, namespace and tokens).

    ``payload=None``: the checksum is left a placeholder (0), for ``Client.reserve`` with
    ``checksum_at_commit``, where the writer gives the checksum with the commit.
    """
    fp, _ = namespace_fingerprint(ns)
    tb = _tokens_to_bytes(tokens)
    if payload is None:
        return unsealed_header(chunk_key(parent, fp, tb), parent, fp, tb, dtype, shape)
    return make_header(
        key=chunk_key(parent, fp, tb),
        parent=parent,
        fingerprint=fp,
        token_bytes=tb,
        dtype=dtype,
        shape=shape,
        payload=as_u8(payload).data,
    )


def unsealed_header(
    key: ChunkKey,
    parent: ChunkKey,
    fingerprint: Fingerprint,
    token_bytes: bytes,
    dtype: str,
    shape: Sequence[int],
) -> RecordHeader:
    """A RAW record header whose payload checksum the writer gives at Commit (where the
    server seals it into the header)."""
    size = prod(int(d) for d in shape) * dtype_itemsize(dtype)
    return make_header(
        key=key,
        parent=parent,
        fingerprint=fingerprint,
        token_bytes=token_bytes,
        dtype=dtype,
        shape=shape,
        stored_size=size,
        payload_checksum=0,
    )


def lookup_hashes(
    fingerprint: Fingerprint, token_bytes: memoryview, chunk_tokens: int, granularity: int
) -> tuple[bytes, bytes]:
    """What a Lookup by keys carries for a prompt (u32le token ids) with every chunk's
    sub-hashes: its chunk keys, 32 bytes each, as puts key the chunks
    (``keys.chunk_keys``), and each chunk's ``keys.sub_hashes`` at the server's
    granularity, concatenated (the proto's LookupRequest.chunk_keys and sub_hashes)."""
    step = chunk_tokens * 4
    keys = accel.chain_keys(chunk_prefix(fingerprint), ROOT, token_bytes, step)
    subs = [
        sub_hashes(token_bytes[s : s + step], granularity) for s in range(0, len(token_bytes), step)
    ]
    return b"".join(keys), b"".join(subs)


class GetAssembler:
    """Takes apart the frames of a Get stream: the header, then the payload pieces."""

    def __init__(self, key: bytes, out: np.ndarray | None) -> None:
        self.key, self.out = key, out
        self.header: RecordHeader | None = None
        self.pieces: builtins.list[memoryview] = []
        self.pos = 0
        self.hash = xxhash.xxh3_64()

    def add(self, raw: bytes) -> None:
        field, data = unframe(raw, pb.GetResponse)
        if self.header is None:
            if field != 1:
                raise ServerError("the Get stream did not start with a record header")
            self.header = parse_header(data, expect_key=self.key)
            if self.out is not None and self.out.size < self.header.raw_size:
                raise InvalidArgument(
                    f"output buffer holds {self.out.size} bytes, the payload "
                    f"is {self.header.raw_size}"
                )
            return
        n = data.nbytes
        if field != 2 or self.pos + n > self.header.raw_size:
            raise CorruptRecord(f"the Get stream of {self.key.hex()[:16]} runs past its payload")
        self.hash.update(data)
        if self.out is not None:
            self.out[self.pos : self.pos + n] = np.frombuffer(data, np.uint8)
        else:
            self.pieces.append(data)
        self.pos += n

    def finish(self) -> tuple[RecordHeader, bytes] | None:
        """The header and payload (b"" when it went into ``out``), or None on a miss."""
        h = self.header
        if h is None:
            return None
        if self.pos != h.raw_size:
            raise CorruptRecord(
                f"the Get stream ended after {self.pos} payload bytes, expected {h.raw_size}"
            )
        if self.hash.intdigest() != h.payload_checksum:
            raise CorruptRecord("payload from the Get stream fails its checksum")
        return h, (b"".join(self.pieces) if self.out is None else b"")
