"""Which Redis/Valkey client can move big record values at wire speed? Every candidate
against loopback TCP, measured in the same run (issue 14, step 1).

    python -m benchmarks.remote_candidates [--quick] [--json out.json] [--markdown out.md]

For redis-server and valkey-server (standalone, started on free ports, no
persistence) and values of 1, 4, 16 and 64 MiB, the cases take turns
(``harness.interleaved``):

- ``tcp``: Python sockets over loopback TCP to another process (``harness.LoopbackTcp``),
  the limit every other case is divided by;
- ``py``: the client the tier used until now, pure-Python reply parser (redis-py for
  Redis, valkey-py for Valkey): ``GET`` and a copy into the destination, ``SET`` of the
  bytes;
- ``hiredis``: redis-py with the hiredis C parser (``pip install hiredis``);
- ``glide``: valkey-glide's sync client (``pip install valkey-glide-sync``: a Rust core);
- ``resp``: kvstore's own RESP client (``kvstore.engine.tiers.remote_resp``): ``recv_into``
  straight into the destination, values sent as the caller's buffer;
- ``split4-par``: the value cut into 4 keys, each moved by ``resp`` on its own connection
  in its own thread;
- ``split4-pipe``: the same 4 keys, pipelined on one ``resp`` connection;
- ``parts-2MiB-w4``: what the tier settled on (``kvstore.engine.tiers.remote_parts``): parts of
  2 MiB on one connection, at most 4 in flight.

A GET lands in the same preallocated destination (``harness.touched``) whatever the
client, so every case pays for getting the bytes where a reader wants them. The
candidates that are not installed are left out (the run says so).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstore.engine.tiers.remote_parts import PART_BYTES, WINDOW
from kvstore.engine.tiers.remote_resp import Reader, RespConnection, RespPool

from .harness import (
    GB,
    PACKAGE,
    LoopbackTcp,
    MiB,
    Progress,
    Record,
    interleaved,
    machine_info,
    make_progress,
    markdown,
    median,
    random_bytes,
    size_label,
    touched,
    write_json,
)

FLAVORS = ("redis", "valkey")
SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
PARTS = 4
TIMEOUT_S = 30.0
TCP = "loopback TCP (Python sockets, another process)"

Case = Callable[[], object] | tuple[Callable[[], object], Callable[[], object]]


def _py_client(flavor: str, port: int, hiredis: bool) -> Any:
    """redis-py / valkey-py with the pure-Python parser, or redis-py with hiredis."""
    if flavor == "valkey" and not hiredis:
        import valkey
        from valkey._parsers import _RESP2Parser as ValkeyParser

        vpool = valkey.ConnectionPool(
            port=port, socket_timeout=TIMEOUT_S, parser_class=ValkeyParser
        )
        return valkey.Valkey(connection_pool=vpool)
    import redis
    from redis._parsers import _HiredisParser, _RESP2Parser

    parser = _HiredisParser if hiredis else _RESP2Parser
    rpool = redis.ConnectionPool(port=port, socket_timeout=TIMEOUT_S, parser_class=parser)
    return redis.Redis(connection_pool=rpool)


def _glide_client(port: int) -> Any:
    from glide_sync import GlideClient, GlideClientConfiguration, NodeAddress

    config = GlideClientConfiguration(
        [NodeAddress("127.0.0.1", port)], request_timeout=int(TIMEOUT_S * 1000)
    )
    return GlideClient.create(config)


def available() -> dict[str, bool]:
    found = {}
    for name, module in (("hiredis", "hiredis"), ("glide", "glide_sync")):
        try:
            __import__(module)
            found[name] = True
        except ImportError:
            found[name] = False
    return found


def _sink(view: memoryview) -> Callable[[int, Reader], int]:
    def sink(n: int, reader: Reader) -> int:
        if n != len(view):
            raise RuntimeError(f"value of {n} bytes, expected {len(view)}")
        reader.read_into(view)
        return n

    return sink


def _cases(
    flavor: str,
    port: int,
    n: int,
    src: np.ndarray,
    dst: np.ndarray,
    tcp: LoopbackTcp,
    found: dict[str, bool],
    pool: ThreadPoolExecutor,
    close: list[Callable[[], object]],
) -> dict[str, Case]:
    sv, dv = memoryview(src), memoryview(dst)
    key = f"cand:{n}"
    cases: dict[str, Case] = {"tcp.get": lambda: tcp.get_into(dst), "tcp.put": lambda: tcp.put(src)}

    def lib_cases(name: str, client: Any) -> None:
        def get() -> None:
            blob = client.get(key)
            dst[:] = np.frombuffer(blob, np.uint8)

        cases[f"{name}.get"] = get
        cases[f"{name}.set"] = (lambda: client.set(f"{key}:{name}", sv), lambda: None)

    py = _py_client(flavor, port, hiredis=False)
    close.append(py.close)
    py.set(key, sv)
    lib_cases("py", py)
    if found["hiredis"]:
        hi = _py_client(flavor, port, hiredis=True)
        close.append(hi.close)
        lib_cases("hiredis", hi)
    if found["glide"]:
        gl = _glide_client(port)
        close.append(gl.close)
        lib_cases("glide", gl)

    resp = RespPool("127.0.0.1", port, connect_timeout_s=5.0)
    close.append(resp.close)

    def call(args: tuple[Any, ...], sink: Any = None) -> object:
        return resp.run(lambda c: c.call(args, TIMEOUT_S, sink))

    cases["resp.get"] = lambda: call(("GET", key), _sink(dv))
    cases["resp.set"] = lambda: call(("SET", f"{key}:resp", sv))

    step = n // PARTS
    names = [f"{key}:part{i}" for i in range(PARTS)]
    for i, name in enumerate(names):
        call(("SET", name, sv[i * step : (i + 1) * step]))

    def par(fn: Callable[[int], object]) -> None:
        for f in [pool.submit(fn, i) for i in range(PARTS)]:
            f.result()

    def part_get(i: int) -> object:
        return call(("GET", names[i]), _sink(dv[i * step : (i + 1) * step]))

    def part_set(i: int) -> object:
        return call(("SET", f"{names[i]}:w", sv[i * step : (i + 1) * step]))

    def pipe(conn: RespConnection, write: bool) -> None:
        if write:
            cmds = [
                (("SET", f"{nm}:p", sv[i * step : (i + 1) * step]), None)
                for i, nm in enumerate(names)
            ]
        else:
            cmds = [
                (("GET", nm), _sink(dv[i * step : (i + 1) * step])) for i, nm in enumerate(names)
            ]
        for r in conn.pipeline(cmds, TIMEOUT_S):
            if isinstance(r, Exception):
                raise r

    # What the tier does with records over PART_BYTES: parts of PART_BYTES, WINDOW in flight.
    spans = [(a, min(n, a + PART_BYTES)) for a in range(0, n, PART_BYTES)]
    tier_names = [f"{key}:tier{i}" for i in range(len(spans))]
    for name, (a, b) in zip(tier_names, spans, strict=True):
        call(("SET", name, sv[a:b]))
    tier_gets = [
        (("GET", nm), _sink(dv[a:b])) for nm, (a, b) in zip(tier_names, spans, strict=True)
    ]
    tier_sets = [
        (("SET", f"{nm}:w", sv[a:b]), None) for nm, (a, b) in zip(tier_names, spans, strict=True)
    ]
    cases["parts-2MiB-w4.get"] = lambda: resp.run(lambda c: c.stream(tier_gets, TIMEOUT_S, WINDOW))
    cases["parts-2MiB-w4.set"] = lambda: resp.run(lambda c: c.stream(tier_sets, TIMEOUT_S, WINDOW))
    cases["split4-par.get"] = lambda: par(part_get)
    cases["split4-par.set"] = lambda: par(part_set)
    cases["split4-pipe.get"] = lambda: resp.run(lambda c: pipe(c, False))
    cases["split4-pipe.set"] = lambda: resp.run(lambda c: pipe(c, True))
    return cases


def bench_flavor(
    flavor: str, port: int, tcp: LoopbackTcp, sizes: tuple[int, ...], reps: int, progress: Progress
) -> list[Record]:
    found = available()
    out: list[Record] = []
    with ThreadPoolExecutor(PARTS) as pool:
        for n in sizes:
            src = random_bytes(n, n % 997)
            dst = touched(n)
            close: list[Callable[[], object]] = []
            try:
                cases = _cases(flavor, port, n, src, dst, tcp, found, pool, close)
                t = interleaved(cases, reps, progress, f"candidates {flavor} {size_label(n)}")
                for name in [c for c in cases if c.endswith(".get") and not c.startswith("tcp")]:
                    dst.fill(0)
                    fn = cases[name]
                    (fn[0] if isinstance(fn, tuple) else fn)()
                    if not np.array_equal(dst, src):
                        raise RuntimeError(f"{flavor} {name}: other bytes than were stored")
            finally:
                for fn in close:
                    fn()

            def gbs(case: str) -> float:
                return n / median(t[case]) / GB  # noqa: B023  (used at once, in this iteration)

            for case in cases:
                if case.startswith("tcp."):
                    continue
                cand, op = case.rsplit(".", 1)
                limit = gbs("tcp.get" if op == "get" else "tcp.put")
                out.append(
                    Record(
                        f"l3cand.{flavor}.{cand}.{op}.{size_label(n)}",
                        gbs(case),
                        "GB/s",
                        limit,
                        limit_name=TCP,
                        notes=f"{flavor}-server standalone on loopback; {op.upper()} of a "
                        f"{size_label(n)} value"
                        + (", into the same buffer" if op == "get" else ""),
                        suite="remote_candidates",
                    )
                )
    return out


def run(quick: bool, progress: Progress) -> list[Record]:
    from kvstore.testing.redis import RedisServer
    from kvstore.testing.redis import available as server_available

    sizes = (1 * MiB, 4 * MiB) if quick else SIZES
    reps = 3 if quick else 9
    out: list[Record] = []
    with LoopbackTcp() as tcp:
        for flavor in FLAVORS:
            if not server_available(flavor):
                continue
            with RedisServer(flavor) as server:
                out += bench_flavor(flavor, server.port, tcp, sizes, reps, progress)
    return out


def table(records: list[Record]) -> str:
    """One line per flavor, op and candidate: the ratio to TCP at each size (GB/s in brackets)."""
    by: dict[tuple[str, str, str], dict[str, Record]] = {}
    sizes: list[str] = []
    for r in records:
        _, flavor, rest = r.name.split(".", 2)
        cand, op, size = rest.rsplit(".", 2)
        by.setdefault((flavor, op, cand), {})[size] = r
        if size not in sizes:
            sizes.append(size)
    lines = [
        "| server | op | client | " + " | ".join(sizes) + " |",
        "| --- | --- | --- | " + " | ".join("---:" for _ in sizes) + " |",
    ]
    for (flavor, op, cand), row in sorted(by.items()):
        cells = [f"{row[s].ratio:.2f} ({row[s].value:.2f})" if s in row else "" for s in sizes]
        lines.append(f"| {flavor} | {op.upper()} | {cand} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.remote_candidates", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 and 4 MiB, 3 repetitions")
    ap.add_argument("--json", metavar="FILE", help="write the records as JSON")
    ap.add_argument("--markdown", metavar="FILE", help="write the full table of records")
    args = ap.parse_args(argv)
    missing = [k for k, v in available().items() if not v]
    if missing:
        print(f"not installed, left out: {', '.join(missing)}", file=sys.stderr)
    records = run(args.quick, make_progress(sys.stderr.isatty()))
    if args.json:
        write_json(records, args.json)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(records, machine_info(), "remote client candidates") + "\n")
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
