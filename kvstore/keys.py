"""Chunk keys: the namespace fingerprint and the chained hash of a token prefix.

The scheme is written down, with test vectors, in ``docs/keys.md``; the vectors
are checked by ``tests/test_keys.py``. It must give the same bytes on every host,
process, restart and Python version, so it uses only BLAKE2b from the standard
library over explicitly little-endian integers: never ``hash()``, never pickling.

key(-1) = 32 zero bytes (ROOT)
key(i)  = BLAKE2b-256(person="kvstore-chunk-v1", key(i-1) || fingerprint || u32le tokens of chunk i)

BLAKE2b rather than BLAKE3: measured here, the Python blake3 binding costs more
per call than hashlib's BLAKE2b for 1 KiB inputs, and a 128k-token lookup hashes
512 chunks (see docs/keys.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import NewType

import numpy as np

from kvstore.errors import InvalidArgument

KEY_SCHEME = "kvstore-chunk-v1"
KEY_BYTES = 32
FINGERPRINT_BYTES = 16
SUBHASH_BYTES = 8

ChunkKey = NewType("ChunkKey", bytes)
"""32 bytes: the chained hash of a namespace and a token prefix ending on a chunk."""

Fingerprint = NewType("Fingerprint", bytes)
"""16 bytes: the hash of everything that changes the KV bytes for the same tokens."""

ROOT = ChunkKey(bytes(KEY_BYTES))

_CHUNK_PERSON = b"kvstore-chunk-v1"
_NS_PERSON = b"kvstore-ns-v1"
_SUB_PERSON = b"kvstore-sub-v1"
_MAX_TOKEN = 2**32 - 1


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the KV bytes for the same tokens.

    Two engines share KV only when every field matches; the fingerprint is
    folded into every chunk key, so KV of one model, layout or rank can never be
    found under another's keys.
    """

    model: str  # model id as the engine names it, e.g. "meta-llama/Llama-3.1-8B"
    revision: str = ""  # model revision or weights hash; "" when unknown
    dtype: str = ""  # KV cache dtype, e.g. "bfloat16"
    layout: str = ""  # KV layout: layers, kv heads, head size, block size, attention layout
    device: str = ""  # device kind the bytes were laid out for: "cuda", "cpu", ...
    tp_rank: int = 0  # tensor-parallel rank and world size
    tp_size: int = 1
    pp_rank: int = 0  # pipeline-parallel rank and world size
    pp_size: int = 1
    lora: str = ""  # LoRA adapter name or hash; "" for the base model
    salt: str = ""  # cache_salt / tenant: isolates users that must not share KV
    extra: tuple[tuple[str, str], ...] = field(default=())  # anything else, as sorted pairs

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("Namespace.model must be a non-empty string")
        for name in ("tp", "pp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise InvalidArgument(
                    f"Namespace.{name}_rank={rank} must be in [0, {name}_size={size}) "
                    f"and {name}_size >= 1"
                )

    def canonical(self) -> bytes:
        """The bytes the fingerprint is computed over: sorted-key compact JSON."""
        data = asdict(self)
        data["extra"] = [list(p) for p in sorted(self.extra)]
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint(
            hashlib.blake2b(
                self.canonical(), digest_size=FINGERPRINT_BYTES, person=_NS_PERSON
            ).digest()
        )


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian u32, rejecting ids that do not fit."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"tokens must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise InvalidArgument(f"token ids must be in [0, {_MAX_TOKEN}]")
    return arr.astype("<u4", copy=False).tobytes()


def bytes_to_tokens(data: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(data, dtype="<u4")


_CHUNK_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=_CHUNK_PERSON)


def chunk_key(
    parent: ChunkKey, fingerprint: Fingerprint, token_bytes: bytes | memoryview
) -> ChunkKey:
    """The key of one chunk given its parent's key and its tokens as u32le bytes."""
    h = _CHUNK_HASHER.copy()  # copying a keyed-up hasher skips parsing its parameters
    h.update(parent + fingerprint)
    h.update(token_bytes)
    return ChunkKey(h.digest())


def split_chunks(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of a prompt of n_tokens; the last may be shorter."""
    if chunk_tokens <= 0:
        raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
    return [(s, min(s + chunk_tokens, n_tokens)) for s in range(0, n_tokens, chunk_tokens)]


def chunk_keys(
    fingerprint: Fingerprint,
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    *,
    full_only: bool = False,
) -> list[ChunkKey]:
    """The chained keys of every chunk of ``tokens`` (the last chunk may be short).

    With ``full_only`` the trailing short chunk, if any, gets no key.
    """
    raw = memoryview(tokens_to_bytes(tokens))
    keys: list[ChunkKey] = []
    parent = ROOT
    n = len(raw) // 4
    for start, end in split_chunks(n, chunk_tokens):
        if full_only and end - start < chunk_tokens:
            break
        parent = chunk_key(parent, fingerprint, raw[start * 4 : end * 4])
        keys.append(parent)
    return keys


def sub_hashes(token_bytes: bytes | memoryview, granularity: int) -> bytes:
    """Cumulative prefix hashes of one chunk's tokens, one per ``granularity`` tokens.

    Entry j (8 bytes) hashes the chunk's first (j+1)*granularity tokens. Two
    chunks under the same parent share their first m*granularity tokens exactly
    when their first m entries are equal, so partial matching compares these
    instead of keeping every token id in memory. Only whole units are hashed.
    """
    if granularity <= 0:
        raise InvalidArgument(f"granularity must be positive, got {granularity}")
    view = memoryview(token_bytes)
    step = granularity * 4
    h = hashlib.blake2b(digest_size=SUBHASH_BYTES, person=_SUB_PERSON)
    out = bytearray()
    for off in range(0, len(view) - step + 1, step):
        h.update(view[off : off + step])
        out += h.copy().digest()
    return bytes(out)


def common_units(a: bytes, b: bytes) -> int:
    """How many leading sub-hash entries two sub-hash strings share."""
    n = min(len(a), len(b)) // SUBHASH_BYTES
    if a[: n * SUBHASH_BYTES] == b[: n * SUBHASH_BYTES]:
        return n
    lo, hi = 0, n  # invariant: first lo entries equal, first hi entries not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * SUBHASH_BYTES] == b[: mid * SUBHASH_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


def family(parent: ChunkKey, fingerprint: Fingerprint) -> bytes:
    """The name of a chunk's sibling group: its parent, namespaced at the root.

    Every namespace's first chunks share the parent ROOT; grouping siblings by
    the bare parent would let a partial match cross namespaces.
    """
    if parent == ROOT:
        return ROOT[:FINGERPRINT_BYTES] + fingerprint
    return parent


def key_hex(key: bytes) -> str:
    return key.hex()


def parse_key(text: str) -> ChunkKey:
    """A key from its 64-character hex form (as the CLI and listings print it)."""
    try:
        raw = bytes.fromhex(text)
    except ValueError as e:
        raise InvalidArgument(f"a chunk key is {KEY_BYTES * 2} hex characters, got {text!r}") from e
    if len(raw) != KEY_BYTES:
        raise InvalidArgument(f"a chunk key is {KEY_BYTES * 2} hex characters, got {len(text)}")
    return ChunkKey(raw)
