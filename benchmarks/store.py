"""Store-library benchmarks (issue "Tiered store library"), each against a limit.

- L1 put / get_into (MemoryTier and TieredStore, memory only, write-back) vs
  single-thread memcpy of the same bytes into a preallocated, already-touched
  buffer. The arena pages are touched too (fallocated, MAP_POPULATE), so the
  memcpy is what a put or get_into would cost with no bookkeeping at all.
- L2 (DiskTier, LMDB, raw codec) warm get_into vs memcpy, and vs a raw py-lmdb
  ``txn.get`` (zero-copy buffer) plus a copy of the same payload into the same
  buffer: the LMDB limit, what get_into costs minus verification and bookkeeping.
  L2 put vs a raw py-lmdb put (sync=False) of the same record bytes.
- Chunk sizes: 64 KiB to 64 MiB (full), 64 KiB, 1 and 8 MiB (quick).
- Lookup of a 128k-token prompt in an index of up to 1M keys. The limit is the
  cost of hashing the prompt's chunk keys (``keys.chunk_keys``): a lookup must
  compute every key of the prompt, so it can only add dict probes on top. That
  hashing in turn is compared with one SHA-256 pass over the same token bytes.
- Codecs on bf16 KV-like data: compression ratio, and encode/decode GB/s vs memcpy.
"""

from __future__ import annotations

import gc
import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from kvstore.config import DiskConfig, MemoryConfig, StoreConfig
from kvstore.engine.index import Entry, Index
from kvstore.engine.lookup import lookup
from kvstore.engine.store import TieredStore
from kvstore.engine.tiers.disk import DiskTier
from kvstore.engine.tiers.memory import MemoryTier
from kvstore.keys import ROOT, ChunkKey, Fingerprint, Namespace, chunk_key, chunk_keys, family
from kvstore.records import Codec, RecordHeader, decode_payload, encode_payload, make_header

from .harness import (
    GB,
    Case,
    KiB,
    MiB,
    Progress,
    Record,
    interleaved,
    median,
    memcpy,
    percentile,
    random_bytes,
    size_label,
    touched,
)

NS = Namespace(model="bench-model", dtype="bfloat16", layout="bench")
FP = NS.fingerprint
CHUNK = 256  # tokens per chunk (the store's default)
GRANULARITY = 16
MEMCPY = "memcpy (1 thread, touched dst)"
HASH_NOTE = "limit: keys.chunk_keys of the same prompt (the hashes a lookup cannot skip)"


@dataclass(frozen=True)
class Params:
    sizes: tuple[int, ...]  # chunk payload bytes for L1 and L2
    copy_reps: int
    store_sizes: tuple[int, ...]  # index sizes (keys) for the lookup sweep
    lookup_reps: int  # per point of a sweep
    main_reps: int  # for p50/p99 at the largest index
    prompt_lengths: tuple[int, ...]
    codec_bytes: int
    codec_reps: int

    @classmethod
    def make(cls, quick: bool) -> Params:
        lengths = (1024, 8192, 32768, 131072)
        if quick:
            return cls(
                sizes=(64 * KiB, 1 * MiB, 8 * MiB),
                copy_reps=12,
                store_sizes=(1_000, 100_000),
                lookup_reps=30,
                main_reps=100,
                prompt_lengths=lengths,
                codec_bytes=2 * MiB,
                codec_reps=3,
            )
        return cls(
            # 64 KiB to 64 MiB: 1, 8 and 32 MiB are the sizes docs/performance.md cites.
            sizes=(64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB),
            copy_reps=41,
            store_sizes=(1_000, 10_000, 100_000, 1_000_000),
            lookup_reps=151,
            main_reps=501,
            prompt_lengths=lengths,
            codec_bytes=8 * MiB,
            codec_reps=11,
        )


def run(quick: bool, progress: Progress) -> list[Record]:
    p = Params.make(quick)
    records: list[Record] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-store-bench-") as tmp:
        records += bench_l1(p, progress, tmp)
        records += bench_lmdb(p, progress, tmp)
    records += bench_codecs(p, progress)
    records += bench_lookup(p, progress)  # last: it builds the big index
    return records


# -- shared builders ----------------------------------------------------------------
def chunk(
    nbytes: int, seed: int, payload: np.ndarray | None = None, fp: Fingerprint = FP
) -> tuple[RecordHeader, np.ndarray]:
    """A raw bf16 record of ``nbytes`` payload (random unless given) for a first chunk."""
    tb = np.arange(seed * CHUNK, (seed + 1) * CHUNK, dtype="<u4").tobytes()
    if payload is None:
        payload = random_bytes(nbytes, seed)
    header = make_header(
        key=chunk_key(ROOT, fp, tb),
        parent=ROOT,
        fingerprint=fp,
        token_bytes=tb,
        dtype="bfloat16",
        shape=(CHUNK, nbytes // (2 * CHUNK)),
        payload=payload.data,
    )
    return header, payload


def throughput(
    name: str,
    nbytes: int,
    t: dict[str, list[float]],
    case: str,
    notes: str,
    *,
    limit: str = "memcpy",
    limit_name: str = MEMCPY,
    target: str = "ratio >= 0.5",
) -> Record:
    """GB/s of ``t[case]`` and of ``t[limit]``, from the medians of interleaved timings."""
    value, lim = nbytes / median(t[case]) / GB, nbytes / median(t[limit]) / GB
    return Record(name, value, "GB/s", lim, value / lim, limit_name, target, notes)


# -- L1 --------------------------------------------------------------------------------
PUT_NOTE = (
    "limit: memcpy of the same source into a touched buffer; the arena pages are "
    "pre-faulted too, so this is the copy a put cannot avoid"
)
GET_NOTE = "limit: memcpy into the same destination buffer get_into fills"


def bench_l1(p: Params, progress: Progress, tmp: str) -> list[Record]:
    biggest = max(p.sizes)
    arena = 4 * biggest + 4 * MiB  # the store's records plus the tier-level ones
    cfg = StoreConfig(
        data_dir=os.path.join(tmp, "l1"),
        chunk_tokens=CHUNK,
        granularity=GRANULARITY,
        write_policy="write-back",
        memory=MemoryConfig(capacity_bytes=arena),
        disk=DiskConfig(enabled=False),
    )
    store = TieredStore(cfg)
    try:
        plain = MemoryTier(MemoryConfig(capacity_bytes=2 * biggest + 4 * MiB, verify_reads=False))
        try:
            return [r for n in p.sizes for r in _l1_size(store, plain, n, p, progress)]
        finally:
            plain.close()
    finally:
        store.close()


def _l1_size(
    store: TieredStore, plain: MemoryTier, nbytes: int, p: Params, progress: Progress
) -> list[Record]:
    label, tier = size_label(nbytes), store.memory
    fp = Namespace(model=f"bench-{label}").fingerprint  # the store: one shape per namespace
    put_h, put_p = chunk(nbytes, 1, fp=fp)  # put and deleted every repetition
    sput_h, _ = chunk(nbytes, 2, put_p, fp)  # the same payload under its own key
    get_h, get_p = chunk(nbytes, 3, fp=fp)  # stays in L1 for the reads
    src, dst = put_p.data, touched(nbytes)
    out_mv = dst.data
    if not (store.put(get_h, get_p.data).ok and plain.put(get_h, get_p.data).ok):
        raise AssertionError("L1 refused a chunk it has room for")
    cases: dict[str, Case] = {
        "memcpy": memcpy(put_p, dst),
        "tier.put": (lambda: tier.put(put_h, src), lambda: tier.delete(put_h.key)),
        "store.put": (lambda: store.put(sput_h, src), lambda: store.delete(sput_h.key)),
        "tier.get_into": lambda: tier.get_into(get_h.key, out_mv),
        "tier.get_into.noverify": lambda: plain.get_into(get_h.key, out_mv),
        "store.get_into": lambda: store.get_into(get_h.key, out_mv),
    }
    t = interleaved(cases, p.copy_reps, progress, f"L1 {label}")
    if not np.array_equal(dst, get_p):
        raise AssertionError("L1 get_into delivered other bytes than were put")
    store.delete(get_h.key)
    plain.delete(get_h.key)
    notes = {
        "tier.put": "MemoryTier.put; " + PUT_NOTE,
        "store.put": "TieredStore.put, memory only, write-back (adds key check, index update)",
        "tier.get_into": GET_NOTE + "; verify_reads=true (the default): xxh3 of the "
        "delivered bytes, hashed as they are copied (one pass with the native module)",
        "tier.get_into.noverify": "verify_reads=false: the copy alone",
        "store.get_into": "TieredStore.get_into, L1 hit, verify_reads=true",
    }
    return [throughput(f"l1.{c}.{label}", nbytes, t, c, note) for c, note in notes.items()]


# -- L2 (LMDB) -------------------------------------------------------------------------
def bench_lmdb(p: Params, progress: Progress, tmp: str) -> list[Record]:
    total = sum(p.sizes)
    disk = DiskTier(
        DiskConfig(capacity_bytes=2 * total + 64 * MiB, codec="raw"), os.path.join(tmp, "l2")
    )
    try:
        raw_path = Path(tmp, "raw-lmdb")
        raw_path.mkdir()
        env = lmdb.open(str(raw_path), map_size=4 * total + 64 * MiB, sync=False, metasync=False)
        try:
            return [
                r
                for i, n in enumerate(p.sizes)
                for r in _lmdb_size(disk, env, n, 10 + i, p, progress)
            ]
        finally:
            env.close()
    finally:
        disk.close()


def _lmdb_size(
    disk: DiskTier, env: lmdb.Environment, nbytes: int, seed: int, p: Params, progress: Progress
) -> list[Record]:
    label = size_label(nbytes)
    header, payload = chunk(nbytes, seed)
    if not disk.put(header, payload.data).ok:
        raise AssertionError("the disk tier refused a chunk it has room for")
    key, hs = bytes(header.key), header.header_size
    with env.begin(write=True) as txn:
        txn.put(key, header.pack() + payload.tobytes())
    dst = touched(nbytes)
    out_mv = dst.data
    if disk.get_into(header.key, out_mv) is None:  # warms the page cache
        raise AssertionError("the disk tier lost a chunk just put")

    def raw_get() -> None:
        with env.begin(buffers=True) as txn:
            view = txn.get(key)
            if view is None:
                raise AssertionError("raw LMDB lost its record")
            dst[:] = np.frombuffer(view, np.uint8, nbytes, hs)

    # Puts: a second key with the same payload, deleted again (untimed) after each put.
    put_h, _ = chunk(nbytes, seed + 100, payload)
    put_key, blob = bytes(put_h.key), put_h.pack() + payload.tobytes()

    def raw_put() -> None:
        with env.begin(write=True) as txn:
            txn.put(put_key, blob)

    def raw_undo() -> None:
        with env.begin(write=True) as txn:
            txn.delete(put_key)

    def disk_put() -> None:
        if not disk.put(put_h, payload.data).ok:
            raise AssertionError("the disk tier refused a chunk it has room for")

    t = interleaved(
        {
            "memcpy": memcpy(payload, dst),
            "disk.get_into": lambda: disk.get_into(header.key, out_mv),
            "lmdb.get": raw_get,
            "disk.put": (disk_put, lambda: disk.delete(put_h.key)),
            "lmdb.put": (raw_put, raw_undo),
        },
        p.copy_reps,
        progress,
        f"LMDB {label}",
    )
    if not np.array_equal(dst, payload):
        raise AssertionError("DiskTier.get_into delivered other bytes than were put")
    return [
        throughput(
            f"l2.get_into.{label}",
            nbytes,
            t,
            "disk.get_into",
            "DiskTier (LMDB, raw codec), warm page cache: parse the header, copy the "
            "payload out of the map, hashing it as it is copied",
        ),
        throughput(
            f"l2.get_into.vs_lmdb.{label}",
            nbytes,
            t,
            "disk.get_into",
            "limit: py-lmdb txn.get (buffers=True) + numpy copy of the same payload into the "
            "same buffer (its own env)",
            limit="lmdb.get",
            limit_name="raw py-lmdb get + copy",
            target="",
        ),
        throughput(
            f"l2.put.{label}",
            nbytes,
            t,
            "disk.put",
            "DiskTier.put (LMDB, raw codec, durability=process: no fsync): header, xxh3 of "
            "the payload, one write transaction with the record and its index entry",
            limit="lmdb.put",
            limit_name="raw py-lmdb put of the same record bytes",
            target="",
        ),
        throughput(
            f"l2.lmdb_put.{label}",
            nbytes,
            t,
            "lmdb.put",
            "raw py-lmdb put (sync=False) of header + payload vs memcpy: what LMDB itself costs",
            target="",
        ),
        throughput(
            f"l2.lmdb_get_copy.{label}",
            nbytes,
            t,
            "lmdb.get",
            "raw py-lmdb get + copy vs memcpy: what LMDB itself costs",
            target="",
        ),
    ]


# -- lookup ----------------------------------------------------------------------------
def prompt_index(tokens: np.ndarray) -> Index:
    """An index holding every chunk of ``tokens`` as a real entry (half L1, half L2)."""
    index = Index(GRANULARITY)
    parent = ROOT
    n_chunks = -(-len(tokens) // CHUNK)
    for i in range(n_chunks):
        tb = tokens[i * CHUNK : (i + 1) * CHUNK].tobytes()
        key = chunk_key(parent, FP, tb)
        shape = (len(tb) // 4, 32, 2, 8, 128)  # an 8B-class model: 128 KiB per token
        raw = int(np.prod(shape)) * 2
        header = make_header(
            key=key,
            parent=parent,
            fingerprint=FP,
            token_bytes=tb,
            dtype="bfloat16",
            shape=shape,
            stored_size=raw,
            payload_checksum=0,
        )
        index.add(header, 1 if i < n_chunks // 2 else 2)
        parent = key
    return index


def add_filler(index: Index, n: int, seed: int) -> None:
    """``n`` synthetic entries: chains of 64 chunks spread over 8 namespaces.

    Built straight into the index's tables (a real ``Index.add`` needs a header
    and hashes sub-hashes: minutes for 1M keys); lookup reads nothing else.
    """
    rng = np.random.default_rng(seed)
    blob = rng.bytes(32 * n)
    fps = [Fingerprint(hashlib.sha256(bytes([j])).digest()[:16]) for j in range(7)]
    fps.append(FP)
    subs = rng.bytes(8 * CHUNK // GRANULARITY)  # shared: content is irrelevant, memory is not
    raw = CHUNK * 32 * 2 * 8 * 128 * 2
    entries, children = index.entries, index.children
    parent = ROOT
    for i in range(n):
        key = ChunkKey(blob[32 * i : 32 * i + 32])
        fp = fps[(i // 64) % len(fps)]
        if i % 64 == 0:
            parent = ROOT
        entries[key] = Entry(parent, fp, CHUNK, subs, raw, raw + 2048, "bfloat16", 1 << 2, False, 0)
        children.setdefault(family(parent, fp), {})[key] = None
        index.by_ns.setdefault(fp, set()).add(key)
        parent = key


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_lookup(p: Params, progress: Progress) -> list[Record]:
    longest = max(p.prompt_lengths)
    tokens = np.random.default_rng(7).integers(0, 128_000, longest, dtype=np.int64).astype("<u4")
    token_bytes = tokens.tobytes()
    index = prompt_index(tokens)
    n_prompt = len(index)

    def look(toks: np.ndarray | list[int]) -> Callable[[], object]:
        return lambda: lookup(index, FP, toks, chunk_tokens=CHUNK)

    def hashing(toks: np.ndarray) -> Callable[[], object]:
        return lambda: chunk_keys(FP, toks, CHUNK)

    result = lookup(index, FP, tokens, chunk_tokens=CHUNK)
    if result.matched_tokens != longest or result.stop != "complete":
        raise AssertionError(f"the prompt's own chunks must all match: {result}")
    out: list[Record] = []
    rss0 = rss_bytes()
    for size in p.store_sizes:
        gc.collect()
        add_filler(index, size - len(index), seed=size)
        gc.collect()
        cases = {"lookup": look(tokens), "hash": hashing(tokens)}
        t = interleaved(cases, p.lookup_reps, progress, f"lookup, {size:,} keys")
        note = f"{n_prompt} real chunks + synthetic filler; {HASH_NOTE}"
        out.append(latency(f"lookup.128k.p50.keys={size:,}", t["lookup"], t["hash"], note))
    n_keys = len(index)
    per_key = (rss_bytes() - rss0) / max(1, n_keys - n_prompt)
    note = "RSS growth while adding synthetic entries (their sub-hashes are shared: a real "
    note += "entry holds its own, ~160 more bytes)"
    out.append(Record("lookup.index_bytes_per_key", per_key, "B", notes=note))

    # The headline: p50/p99 at the largest index, with the floors next to it.
    diverged = tokens.copy()
    diverged[-100:] = 128_001  # the last chunk diverges mid-chunk: sibling comparison
    result = lookup(index, FP, diverged, chunk_tokens=CHUNK)
    if result.stop != "diverged" or result.matched_tokens != longest - 112:  # 156 -> 144
        raise AssertionError(f"the diverged prompt must match up to its last unit: {result}")
    sha_once = lambda: hashlib.sha256(token_bytes).digest()  # noqa: E731
    gc.collect()
    cases = {
        "lookup": look(tokens),
        "hash": hashing(tokens),
        "sha256": sha_once,
        "diverged": look(diverged),
    }
    t = interleaved(cases, p.main_reps, progress, f"lookup 128k, {n_keys:,} keys")
    # Apart: converting 128k Python ints is slow enough to disturb the others' caches.
    t_list = interleaved(
        {"list": look(tokens.tolist())}, p.lookup_reps, progress, "lookup 128k list"
    )
    keys_note = f"{n_keys:,} keys in the index; "
    out += [
        latency("lookup.128k.p50", t["lookup"], t["hash"], keys_note + HASH_NOTE),
        latency(
            "lookup.128k.p99",
            t["lookup"],
            t["hash"],
            keys_note + "GC left on, as in a server; limit: chunk_keys p99",
            q=99,
        ),
        latency(
            "lookup.128k.diverged.p50",
            t["diverged"],
            t["hash"],
            "the last chunk differs in its last 100 tokens: sibling sub-hash comparison",
        ),
        latency(
            "lookup.128k.list_tokens.p50",
            t_list["list"],
            t["hash"],
            "tokens given as a Python list: includes the list -> u32 array conversion",
        ),
        latency(
            "hash.chunk_keys.128k.p50",
            t["hash"],
            t["sha256"],
            "512 chained SHA-256 calls (kvstore-chunk-v2); the limit hashes the same bytes in "
            "one call: the gap is the per-call cost",
            limit_name="one SHA-256 pass over the same 512 KiB",
            target="",
        ),
    ]
    for n in p.prompt_lengths:
        cases = {"lookup": look(tokens[:n]), "hash": hashing(tokens[:n])}
        t = interleaved(cases, p.lookup_reps, progress, f"lookup {n // 1024}k tokens")
        out.append(
            latency(
                f"lookup.p50.prompt={n // 1024}k",
                t["lookup"],
                t["hash"],
                keys_note + "every chunk stored",
                target="",
            )
        )
    return out


def latency(
    name: str,
    t_case: list[float],
    t_limit: list[float],
    notes: str,
    *,
    q: float = 50,
    limit_name: str = "chunk_keys hashing",
    target: str | None = None,
) -> Record:
    """Percentile ``q`` of a case and of its limit, in ms."""
    value, limit = percentile(t_case, q) * 1e3, percentile(t_limit, q) * 1e3
    goal = f"p{q:g} < 1 ms" if target is None else target
    return Record(name, value, "ms", limit, None, limit_name, goal, notes)


# -- codecs ----------------------------------------------------------------------------
def kv_like(nbytes: int) -> np.ndarray:
    """bf16 values shaped like K/V: normal, with a per-channel scale (a few loud channels)."""
    import torch

    g = torch.Generator().manual_seed(0)
    heads, dim = 8, 128
    scale = torch.exp(torch.randn(heads, dim, generator=g) * 0.75) * 0.5
    x = torch.randn(nbytes // (2 * heads * dim), heads, dim, generator=g) * scale
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(-1).copy()


def bench_codecs(p: Params, progress: Progress) -> list[Record]:
    raw = kv_like(p.codec_bytes)
    out = [
        Record(
            "codec.raw.compression",
            1.0,
            "x",
            notes="raw is stored as is: its cost is the memcpy itself",
        )
    ]
    for codec in (Codec.ZSTD, Codec.ZSTD_SHUFFLE):
        for level in (1, 3):
            out += _codec(raw, codec, level, p, progress)
    return out


def _codec(
    raw: np.ndarray, codec: Codec, level: int, p: Params, progress: Progress
) -> list[Record]:
    n, src = raw.size, raw.data
    dst = touched(n)
    tb = np.arange(CHUNK, dtype="<u4").tobytes()
    stored = encode_payload(src, codec, 2, level)
    header = make_header(
        key=chunk_key(ROOT, FP, tb),
        parent=ROOT,
        fingerprint=FP,
        token_bytes=tb,
        dtype="bfloat16",
        shape=(n // 2,),
        payload=stored,
        codec=codec,
    )
    if bytes(decode_payload(header, stored)) != raw.tobytes():
        raise AssertionError(f"{codec.name} level {level} does not round-trip")
    t = interleaved(
        {
            "memcpy": memcpy(raw, dst),
            "encode": lambda: encode_payload(src, codec, 2, level),
            "decode": lambda: decode_payload(header, stored),
        },
        p.codec_reps,
        progress,
        f"{codec.name.lower()} level {level}",
    )
    name = f"codec.{codec.name.lower()}.l{level}"
    data = f"{size_label(n)} of bf16 KV-like data"
    return [
        Record(f"{name}.compression", n / len(stored), "x", notes=f"raw / stored bytes, {data}"),
        throughput(f"{name}.encode", n, t, "encode", "GB/s of raw input; " + data, target=""),
        throughput(f"{name}.decode", n, t, "decode", "GB/s of raw output; " + data, target=""),
    ]
