"""Chunk keys: the namespace fingerprint and the chained hash of a token prefix.

The scheme is written down, with test vectors, in ``docs/keys.md``; the vectors
are checked by ``tests/test_keys.py``. It must give the same bytes on every host,
process, restart and Python version, so it uses only SHA-256 (FIPS 180-4) from
the standard library over explicitly little-endian integers: never ``hash()``,
never pickling.

block(tag) = the ASCII tag, zero-padded to one 64-byte SHA-256 block
key(-1)    = 32 zero bytes (ROOT)
key(i)     = SHA-256(block("kvstore-chunk-v2") || fingerprint || key(i-1)
                     || u32le tokens of chunk i)

SHA-256 rather than BLAKE2b or BLAKE3: this CPU (like most x86-64 and ARMv8
servers) has SHA instructions, which OpenSSL uses, so the 512 chained 1 KiB
hashes of a 128k-token lookup cost about 0.7 of what the same loop costs with
BLAKE2b (measured in docs/keys.md). Every hash starts with its tag block: a
64-byte block the hash absorbs first, so domain separation costs one block per
call (and nothing per call where a hasher that absorbed it is copied).

The loops over a prompt's chunks run in ``kvstore.accel`` (C where it was built).
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from itertools import pairwise
from typing import NewType, cast

import numpy as np

from kvstore import accel
from kvstore.errors import InvalidArgument

KEY_SCHEME = "kvstore-chunk-v2"
KEY_BYTES = 32
FINGERPRINT_BYTES = 16
SUBHASH_BYTES = 8

ChunkKey = NewType("ChunkKey", bytes)
"""32 bytes: the chained hash of a namespace and a token prefix ending on a chunk."""

Fingerprint = NewType("Fingerprint", bytes)
"""16 bytes: the hash of everything that changes the KV bytes for the same tokens."""

ROOT = ChunkKey(bytes(KEY_BYTES))

_MAX_TOKEN = 2**32 - 1


def _block(tag: str) -> bytes:
    """block(tag): the ASCII tag zero-padded to one 64-byte SHA-256 block."""
    return tag.encode().ljust(64, b"\0")


_CHUNK_BLOCK = _block(KEY_SCHEME)
_SUB_BLOCK = _block("kvstore-sub-v2")
_CHUNK_HASHER = hashlib.sha256(_CHUNK_BLOCK)  # copied, never fed
_NS_HASHER = hashlib.sha256(_block("kvstore-ns-v2"))


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
    # Anything else, as (name, value) string pairs; a mapping or pairs in any order are
    # accepted and kept sorted by name, as the server rebuilds them from the wire's map.
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("Namespace.model must be a non-empty string")
        object.__setattr__(self, "extra", _extra_pairs(self.extra))
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

    @cached_property
    def fingerprint(self) -> Fingerprint:
        # Cached (the instance is frozen): every lookup, put and key of a prompt asks
        # for it, and the JSON and hash behind it cost ~0.05 ms a time.
        h = _NS_HASHER.copy()
        h.update(self.canonical())
        return Fingerprint(h.digest()[:FINGERPRINT_BYTES])


def _extra_pairs(extra: object) -> tuple[tuple[str, str], ...]:
    """``Namespace.extra`` as name-sorted string pairs; anything the wire (a proto
    ``map<string, string>``) cannot carry as given is refused, since the server would
    compute another fingerprint from what arrives and reject every lookup."""
    allowed = "a dict of str to str, or (name, value) pairs of str with distinct names"
    if isinstance(extra, Mapping):
        items = list(extra.items())
    elif isinstance(extra, (str, bytes)) or not isinstance(extra, Iterable):
        raise InvalidArgument(f"Namespace.extra must be {allowed}, got {type(extra).__name__}")
    else:
        items = list(extra)
    pairs = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise InvalidArgument(f"Namespace.extra must be {allowed}, got the item {item!r}")
        name, value = item
        if not (isinstance(name, str) and isinstance(value, str)):
            raise InvalidArgument(
                f"Namespace.extra must be {allowed}, got {name!r}: {value!r} "
                f"({type(name).__name__}: {type(value).__name__})"
            )
        pairs.append((name, value))
    pairs.sort()
    for (a, _), (b, _) in pairwise(pairs):
        if a == b:
            raise InvalidArgument(f"Namespace.extra must be {allowed}: {a!r} is given twice")
    return tuple(pairs)


# Lists and tuples (how vLLM hands prompts over) go through accel.u32le: ~5x faster
# than array("I"), which in turn is 5-6x faster than numpy and range-checks too.
# array("I") holds C unsigned ints: u32 on every platform Python supports.
_ARRAY_U32 = array.array("I").itemsize == 4
_LITTLE = sys.byteorder == "little"


def token_view(tokens: Sequence[int] | np.ndarray) -> memoryview:
    """Token ids as little-endian u32 bytes (format "B"), without a copy when possible.

    A C-contiguous little-endian uint32 array is viewed in place (the caller must
    not change it while the view is in use); anything else is converted once.
    Ids that do not fit in u32 are rejected.
    """
    if isinstance(tokens, (list, tuple)):
        try:
            return memoryview(accel.u32le(tokens))
        except (OverflowError, TypeError) as e:
            raise InvalidArgument(f"token ids must be ints in [0, {_MAX_TOKEN}]: {e}") from e
    if isinstance(tokens, range) and _ARRAY_U32:
        try:
            arr = array.array("I", tokens)
        except (OverflowError, TypeError) as e:
            raise InvalidArgument(f"token ids must be ints in [0, {_MAX_TOKEN}]: {e}") from e
        if not _LITTLE:
            arr.byteswap()
        return memoryview(arr).cast("B")
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise InvalidArgument(f"tokens must be a flat sequence of ints, got shape {a.shape}")
    kind, size = a.dtype.kind, a.dtype.itemsize
    if a.size and kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {a.dtype}")
    if a.size and (kind == "i" or size > 4):
        # One pass: seen as unsigned, a negative id is larger than any valid one.
        signed = kind == "i"
        top = min(_MAX_TOKEN, 2 ** (8 * size - 1) - 1) if signed else _MAX_TOKEN
        if int((a.view(a.dtype.str.replace("i", "u")) if signed else a).max()) > top:
            raise InvalidArgument(f"token ids must be in [0, {_MAX_TOKEN}]")
    return np.ascontiguousarray(a, dtype="<u4").data.cast("B")


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian u32, rejecting ids that do not fit."""
    return token_view(tokens).tobytes()


def bytes_to_tokens(data: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(data, dtype="<u4")


def chunk_prefix(fingerprint: Fingerprint) -> bytes:
    """What every key of a namespace hashes first: block(KEY_SCHEME) || fingerprint.

    ``accel.chain_keys``/``chain_probe`` take it with the parent key and the tokens.
    """
    return _CHUNK_BLOCK + fingerprint


def chunk_key(
    parent: ChunkKey, fingerprint: Fingerprint, token_bytes: bytes | memoryview
) -> ChunkKey:
    """The key of one chunk given its parent's key and its tokens as u32le bytes."""
    h = _CHUNK_HASHER.copy()
    h.update(fingerprint + parent)
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
    if chunk_tokens <= 0:
        raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
    raw = token_view(tokens)
    step = chunk_tokens * 4
    end = len(raw) - len(raw) % step if full_only else len(raw)
    keys = accel.chain_keys(chunk_prefix(fingerprint), ROOT, raw[:end], step)
    return cast(list[ChunkKey], keys)


def sub_hashes(token_bytes: bytes | memoryview, granularity: int) -> bytes:
    """Cumulative prefix hashes of one chunk's tokens, one per ``granularity`` tokens.

    Entry j (8 bytes) hashes the chunk's first (j+1)*granularity tokens. Two
    chunks under the same parent share their first m*granularity tokens exactly
    when their first m entries are equal, so partial matching compares these
    instead of keeping every token id in memory. Only whole units are hashed.
    """
    if granularity <= 0:
        raise InvalidArgument(f"granularity must be positive, got {granularity}")
    return accel.prefix_digests(_SUB_BLOCK, token_bytes, granularity * 4, SUBHASH_BYTES)


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
