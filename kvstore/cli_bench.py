"""``kvstore bench``: put/get throughput against a running server, or the benchmark suite."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvstore import cli_format as fmt
from kvstore.cli_format import CLIError, Doc
from kvstore.keys import ChunkKey, Namespace


def _benchmarks_main() -> Callable[[list[str]], int]:
    """``benchmarks.__main__.main`` from the source checkout (it is not installed)."""
    try:
        from benchmarks.__main__ import main as bench_main
    except ImportError:
        here = Path(__file__).resolve().parents[1]
        for root in (Path.cwd(), here):
            if (root / "benchmarks" / "__main__.py").is_file():
                sys.path.insert(0, str(root))
                break
        else:
            raise CLIError(
                "the benchmark suite lives in the source checkout's benchmarks/ "
                "folder: run `kvstore bench --suite` from the checkout"
            ) from None
        from benchmarks.__main__ import main as bench_main
    return bench_main


def cmd_bench_suite(args: argparse.Namespace) -> Doc:
    import contextlib
    import json
    import tempfile

    bench_main = _benchmarks_main()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or os.path.join(tmp, "records.json")
        argv = ["--json", out]
        argv += ["--only", args.suite] if args.suite != "all" else []
        argv += ["--quick"] if args.quick else []
        argv += ["--no-save"] if args.no_save else []
        argv += [] if args.progress else ["--no-progress"]
        # --json output must stay one JSON document: the suite's table goes to stderr
        sink = sys.stderr if args.json else sys.stdout
        with contextlib.redirect_stdout(sink):
            try:
                rc = bench_main(argv)
            except SystemExit as e:  # argparse in the suite: an unknown suite name
                raise CLIError(
                    f"--suite {args.suite}: not a benchmark suite (see "
                    "`python -m benchmarks --list`)"
                ) from e
        records = json.loads(Path(out).read_text()) if os.path.exists(out) else []
    doc: Doc = {
        "suite": args.suite,
        "quick": args.quick,
        "records": records,
        "json": args.out or None,
    }
    if rc:
        doc["error"] = f"the benchmark suite failed (exit {rc}); see the messages above"
    return doc


def cmd_bench(args: argparse.Namespace) -> Doc:
    if args.suite:
        return cmd_bench_suite(args)
    import uuid

    import numpy as np

    from kvstore.keys import ROOT
    from kvstore.tiers.base import PutStatus

    size, count = args.size, args.count
    from kvstore.client import Client

    with Client(args.url, token=args.token, timeout=args.timeout, shm=args.shm) as c:
        info = c.info()
        if size + 65536 > info.max_chunk_bytes:
            raise CLIError(
                f"--size {fmt.human_bytes(size)} is over the server's largest chunk "
                f"({fmt.human_bytes(info.max_chunk_bytes)} with its header)"
            )
        # A fresh namespace per run: earlier runs' chunks cannot turn puts into EXISTS.
        ns = Namespace(model="kvstore-bench", salt=uuid.uuid4().hex)
        payload = np.random.default_rng().integers(0, 256, size, dtype=np.uint8)
        out = np.empty(size, dtype=np.uint8)
        ct = max(1, info.chunk_tokens)

        def stamp(i: int) -> np.ndarray:  # chunk i's bytes: the random block, i in front
            payload[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)[: min(8, size)]
            return payload

        plane = "shm" if c.shm_active else "stream"  # maps the arena now, outside the timing
        keys: list[tuple[int, ChunkKey]] = []
        statuses = dict.fromkeys((s.name.lower() for s in PutStatus), 0)
        verified = missing = 0
        t_put = t_get = 0.0
        bar = fmt.Progress("put", count, enabled=args.progress)
        for i in range(count):
            tokens = np.arange(i * ct, (i + 1) * ct, dtype=np.uint32)
            data = stamp(i)
            t0 = time.perf_counter()
            key, status = c.put_chunk(ns, ROOT, tokens, data, "uint8", (size,))
            t_put += time.perf_counter() - t0
            statuses[status.name.lower()] += 1
            if status in (PutStatus.STORED, PutStatus.EXISTS):
                keys.append((i, key))
            bar.update()
        bar.close()
        bar = fmt.Progress("get", len(keys), enabled=args.progress)
        for i, key in keys:
            t0 = time.perf_counter()
            found = c.get_into(key, out)
            t_get += time.perf_counter() - t0
            if found is None:
                missing += 1
            elif np.array_equal(out, stamp(i)):
                verified += 1
            bar.update()
        bar.close()
        if not args.keep:
            c.delete([k for _, k in keys])
    doc: Doc = {
        "url": c.url,
        "plane": plane,
        "size_bytes": size,
        "count": count,
        "put": {
            "seconds": t_put,
            "bytes": size * count,
            "gb_per_s": size * count / t_put / 1e9 if t_put else 0.0,
            "statuses": {k: v for k, v in statuses.items() if v},
        },
        "get": {
            "seconds": t_get,
            "bytes": size * len(keys),
            "gb_per_s": size * len(keys) / t_get / 1e9 if t_get else 0.0,
            "missing": missing,
        },
        "verified": verified,
        "kept": args.keep,
    }
    if verified != count:
        doc["error"] = (
            f"only {verified} of {count} chunks were stored and read back intact "
            f"(put statuses {doc['put']['statuses']}, {missing} missing on get)"
        )
    return doc
