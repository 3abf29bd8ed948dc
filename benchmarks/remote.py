"""L3 benchmarks: ``RemoteTier`` put / get_into against Redis and Valkey, each against a limit.

For each flavor installed (redis-server, valkey-server) the suite starts a server on
a free port in a temp dir (``kvstore.testing.redis.RedisServer``: no persistence) and, per
chunk size (64 KiB to 64 MiB), takes turns between:

- ``RemoteTier.put`` of a raw-codec chunk (the value over kvstore's RESP client, in
  2 MiB parts with a manifest last above 2 MiB, then one bookkeeping pipeline and one
  ``INCRBY``) and ``RemoteTier.get_into`` (``GET`` of the record, or of its manifest and
  then its parts, received straight into the destination and verified there);
- the limit: raw redis-py / valkey-py ``SET`` of the same record bytes and ``GET``
  plus a numpy copy of the payload into the same destination buffer (what the
  client library and the server cost on their own, no kvstore code);
- the limit of that limit: Python sockets over loopback TCP moving the same bytes
  to and from another process (``harness.LoopbackTcp``).

Each tier figure is reported twice: against the raw client library
(``l3.<flavor>.put.<size>``) and against loopback TCP (``l3.<flavor>.put.vs_tcp.<size>``,
issue 14's target: >= 0.5 from 1 to 64 MiB). In full mode the tier also runs against a
3-node cluster of each flavor (``kvstore.testing.redis.ServerCluster``;
``l3.<flavor>-cluster.put.vs_tcp.<size>``), and one more pair at 4 MiB uses the remote
tier's default codec (zstd_shuffle, level 1) on bf16 KV-like data, against the same raw
SET/GET of the uncompressed bytes: what the default costs in time for the memory it
saves. Throughputs are in payload bytes per second, for every case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.config import RemoteConfig
from kvstore.engine.tiers.remote import RemoteTier
from kvstore.records import Codec, RecordHeader, build

from .harness import (
    GB,
    KiB,
    LoopbackTcp,
    MiB,
    Progress,
    Record,
    interleaved,
    median,
    size_label,
    touched,
)
from .store import chunk, kv_like

FLAVORS = ("redis", "valkey")
RAW_SET = "raw {lib} SET of the same record bytes"
RAW_GET = "raw {lib} GET + copy of the payload into the same buffer"
TCP = "loopback TCP (Python sockets, another process)"
CODEC_SIZE = 4 * MiB
TARGET = "ratio >= 0.5 (issue 14)"


@dataclass(frozen=True)
class Params:
    sizes: tuple[int, ...]
    reps: int  # up to 4 MiB
    big_reps: int  # above 4 MiB
    codec: bool  # the zstd_shuffle pair

    @classmethod
    def make(cls, quick: bool) -> Params:
        if quick:
            return cls((64 * KiB, 4 * MiB), 5, 3, False)
        return cls((64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB), 21, 9, True)


def run(quick: bool, progress: Progress) -> list[Record]:
    from kvstore.testing.redis import RedisServer, available

    p = Params.make(quick)
    flavors = [f for f in FLAVORS if available(f)]
    if not flavors:
        raise RuntimeError("neither redis-server nor valkey-server is installed")
    out: list[Record] = []
    with LoopbackTcp() as tcp:
        for flavor in flavors:
            with RedisServer(flavor) as server:
                out += bench_flavor(flavor, server.url, server.port, tcp, p, progress)
        if p.codec:  # full mode
            for flavor in flavors:
                out += bench_cluster(flavor, tcp, p, progress)
    return out


def bench_cluster(flavor: str, tcp: LoopbackTcp, p: Params, progress: Progress) -> list[Record]:
    """The tier against a 3-node cluster: values go to the node that owns each slot."""
    from kvstore.testing.redis import ServerCluster

    name = f"{flavor}-cluster"
    out: list[Record] = []
    with ServerCluster(3, flavor) as cluster:
        config = RemoteConfig(
            url=cluster.url, codec="raw", timeout_ms=30_000, connect_timeout_ms=5_000
        )
        with RemoteTier(config) as tier:
            for i, n in enumerate(s for s in p.sizes if s >= MiB):
                reps = p.reps if n <= 4 * MiB else p.big_reps
                label = size_label(n)
                get_h, src = chunk(n, 60 + i)
                put_h, _ = chunk(n, 160 + i, src)
                if not tier.put(get_h, src.data).ok:
                    raise RuntimeError(f"{name}: the remote tier refused a {label} chunk")
                dst = touched(n)
                cases = _tier_cases(tier, put_h, get_h, src, dst)
                cases["tcp.put"] = lambda src=src: tcp.put(src)
                cases["tcp.get"] = lambda dst=dst: tcp.get_into(dst)
                t = interleaved(cases, reps, progress, f"{name} {label}")
                dst.fill(0)
                cases["tier.get_into"]()
                if not np.array_equal(dst, src):
                    raise RuntimeError(f"{name}: get_into delivered other bytes than were put")
                tier.delete(get_h.key)
                out += _vs_tcp(name, n, t)
    return out


def _vs_tcp(flavor: str, n: int, t: dict[str, list[float]]) -> list[Record]:
    label = size_label(n)

    def gbs(case: str) -> float:
        return n / median(t[case]) / GB

    target = TARGET if n >= MiB else ""
    what = f"{flavor} on loopback; the tier's RESP client, parts of 2 MiB above 2 MiB"
    return [
        Record(f"l3.{flavor}.put.vs_tcp.{label}", gbs("tier.put"), "GB/s", gbs("tcp.put"),
               limit_name=TCP, target=target, notes=f"RemoteTier.put, raw codec; {what}"),
        Record(f"l3.{flavor}.get_into.vs_tcp.{label}", gbs("tier.get_into"), "GB/s",
               gbs("tcp.get"), limit_name=TCP, target=target,
               notes=f"RemoteTier.get_into, verified in the destination; {what}"),
    ]  # fmt: skip


def _tier_cases(
    tier: RemoteTier, put_h: RecordHeader, get_h: RecordHeader, src: np.ndarray, dst: np.ndarray
) -> dict[str, Any]:
    out_mv = dst.data

    def tier_put() -> None:
        if not tier.put(put_h, src.data).ok:
            raise RuntimeError("the remote tier refused a put")

    def tier_get() -> None:
        if tier.get_into(get_h.key, out_mv) is None:
            raise RuntimeError("the remote tier lost a chunk")

    return {"tier.put": (tier_put, lambda: tier.delete(put_h.key)), "tier.get_into": tier_get}


def raw_client(flavor: str, port: int) -> Any:
    """The client library RemoteTier uses for this flavor, as plainly as it comes."""
    if flavor == "valkey":
        import valkey

        return valkey.Valkey(host="127.0.0.1", port=port, socket_timeout=30)
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=30)


def bench_flavor(
    flavor: str, url: str, port: int, tcp: LoopbackTcp, p: Params, progress: Progress
) -> list[Record]:
    lib = "valkey-py" if flavor == "valkey" else "redis-py"
    # Generous deadlines: a 64 MiB record takes tens of ms on a busy loopback.
    config = RemoteConfig(url=url, codec="raw", timeout_ms=30_000, connect_timeout_ms=5_000)
    out: list[Record] = []
    with RemoteTier(config) as tier:
        raw = raw_client(flavor, port)
        try:
            for i, n in enumerate(p.sizes):
                reps = p.reps if n <= 4 * MiB else p.big_reps
                out += bench_size(flavor, lib, tier, raw, tcp, n, 20 + i, reps, progress)
            if p.codec:
                codec_config = RemoteConfig(
                    url=url, timeout_ms=30_000, connect_timeout_ms=5_000, prefix="kvs-zstd"
                )
                with RemoteTier(codec_config) as ztier:
                    out += bench_codec(flavor, lib, ztier, raw, p.reps, progress)
        finally:
            raw.flushall()
            raw.close()
    return out


def _cases(
    tier: RemoteTier,
    raw: Any,
    put_h: RecordHeader,
    get_h: RecordHeader,
    src: np.ndarray,
    dst: np.ndarray,
    raw_blob: bytes,
) -> dict[str, Any]:
    """The four timed cases of one size: tier and raw client, put and get."""
    n = src.size
    raw_put, raw_get = f"bench:raw:put:{n}", f"bench:raw:get:{n}"
    raw.set(raw_get, raw_blob)
    hs = len(raw_blob) - n

    def plain_get() -> None:
        blob = raw.get(raw_get)
        dst[:] = np.frombuffer(blob, np.uint8, n, hs)

    return {
        **_tier_cases(tier, put_h, get_h, src, dst),
        "raw.set": (lambda: raw.set(raw_put, raw_blob), lambda: raw.delete(raw_put)),
        "raw.get": plain_get,
    }


def bench_size(
    flavor: str,
    lib: str,
    tier: RemoteTier,
    raw: Any,
    tcp: LoopbackTcp,
    n: int,
    seed: int,
    reps: int,
    progress: Progress,
) -> list[Record]:
    label = size_label(n)
    get_h, src = chunk(n, seed)
    put_h, _ = chunk(n, seed + 100, src)
    if not tier.put(get_h, src.data).ok:
        raise RuntimeError(f"{flavor}: the remote tier refused a {label} chunk")
    dst = touched(n)
    blob = build(put_h, src.data)
    cases = _cases(tier, raw, put_h, get_h, src, dst, bytes(blob))
    cases["tcp.put"] = lambda: tcp.put(src)
    cases["tcp.get"] = lambda: tcp.get_into(dst)
    t = interleaved(cases, reps, progress, f"{flavor} {label}")
    dst.fill(0)
    tier_get = cases["tier.get_into"]
    tier_get()
    if not np.array_equal(dst, src):
        raise RuntimeError(f"{flavor}: get_into delivered other bytes than were put")
    tier.delete(get_h.key)

    def gbs(case: str) -> float:
        return n / median(t[case]) / GB

    what = f"{flavor} on loopback, {lib}"
    return _vs_tcp(flavor, n, t) + [
        Record(f"l3.{flavor}.put.{label}", gbs("tier.put"), "GB/s", gbs("raw.set"),
               limit_name=RAW_SET.format(lib=lib),
               notes=f"RemoteTier.put, raw codec: SET NX (parts first above 2 MiB) + "
               f"bookkeeping pipeline + INCRBY; {what}"),
        Record(f"l3.{flavor}.get_into.{label}", gbs("tier.get_into"), "GB/s", gbs("raw.get"),
               limit_name=RAW_GET.format(lib=lib),
               notes=f"RemoteTier.get_into: GET (manifest, then parts, above 2 MiB) into "
               f"the buffer, verified there; {what}"),
        Record(f"l3.{flavor}.raw_set.{label}", gbs("raw.set"), "GB/s", gbs("tcp.put"),
               limit_name=TCP, notes=f"what the client library and server cost; {what}"),
        Record(f"l3.{flavor}.raw_get.{label}", gbs("raw.get"), "GB/s", gbs("tcp.get"),
               limit_name=TCP, notes=f"GET + copy; the limit receives into the buffer; {what}"),
    ]  # fmt: skip


def bench_codec(
    flavor: str, lib: str, tier: RemoteTier, raw: Any, reps: int, progress: Progress
) -> list[Record]:
    """The default remote codec (zstd_shuffle level 1) on KV-like bf16 data."""
    n = CODEC_SIZE
    src = kv_like(n)
    get_h, _ = chunk(n, 90, src)
    put_h, _ = chunk(n, 91, src)
    if not tier.put(get_h, src.data).ok:
        raise RuntimeError(f"{flavor}: the remote tier refused a zstd_shuffle chunk")
    stored = len(tier.get(get_h.key) or b"")
    if tier.codec != Codec.ZSTD_SHUFFLE or not stored:
        raise RuntimeError(f"{flavor}: expected a zstd_shuffle record, got {tier.codec}")
    dst = touched(n)
    cases = _cases(tier, raw, put_h, get_h, src, dst, bytes(build(put_h, src.data)))
    t = interleaved(cases, reps, progress, f"{flavor} zstd_shuffle {size_label(n)}")
    dst.fill(0)
    cases["tier.get_into"]()
    if not np.array_equal(dst, src):
        raise RuntimeError(f"{flavor}: zstd_shuffle get_into delivered other bytes")
    tier.delete(get_h.key)
    ratio = n / stored
    label = size_label(n)
    note = (
        f"default remote codec zstd_shuffle level 1 on bf16 KV-like data "
        f"({ratio:.2f}x smaller in {flavor}); limit moves the uncompressed bytes"
    )
    return [
        Record(f"l3.{flavor}.put.zstd_shuffle.{label}", n / median(t["tier.put"]) / GB, "GB/s",
               n / median(t["raw.set"]) / GB, limit_name=RAW_SET.format(lib=lib), notes=note),
        Record(f"l3.{flavor}.get_into.zstd_shuffle.{label}",
               n / median(t["tier.get_into"]) / GB, "GB/s", n / median(t["raw.get"]) / GB,
               limit_name=RAW_GET.format(lib=lib), notes=note),
    ]  # fmt: skip
