"""``kvstore bench``: put/get throughput against a running server, or the benchmark suite.

The suite (``--suite``) is installed with the package as ``kvstore.benchmarks`` (the
source checkout's ``benchmarks/`` folder, as ``server/`` installs as ``kvstore.server``).
``kvstore bench --suite`` runs ``python -m kvstore.benchmarks`` in a child process, in
the current directory, with or without a checkout; it never imports the suite into this
process (the suite starts servers and engines of its own and measures limits next to
each figure). Where a full run writes RESULTS.md, results/ and plots/ is the suite's
decision (``kvstore.benchmarks.harness.output_dir``): beside the suite in a source
checkout (an editable install), else ``./kvstore-bench/`` under the current directory.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from kvstore.cli import format as fmt
from kvstore.cli import render as render
from kvstore.cli.format import CLIError, Doc
from kvstore.keys import ChunkKey, Namespace

SUITE_MODULE = "kvstore.benchmarks"  # run as `python -m kvstore.benchmarks`, never imported here


def _fd(stream: IO[str]) -> int | None:
    """``stream``'s file descriptor for a child to write to, or None (an in-memory stream)."""
    try:
        stream.flush()
        return stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _run_suite(argv: list[str], out: IO[str]) -> int:
    """``python -m kvstore.benchmarks argv`` here; its stdout goes to ``out``, stderr to ours."""
    out_fd, err_fd = _fd(out), _fd(sys.stderr)
    done = subprocess.run(
        [sys.executable, "-m", SUITE_MODULE, *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if out_fd is None else out_fd,
        stderr=subprocess.PIPE if err_fd is None else err_fd,
        text=True,
        check=False,
    )
    # Streams without a descriptor (tests calling main() in process) get the text afterwards.
    if out_fd is None:
        out.write(done.stdout)
    if err_fd is None:
        sys.stderr.write(done.stderr)
    return done.returncode


def _known_suites() -> list[str]:
    """The suite names ``python -m kvstore.benchmarks --list`` prints (the suite's own list)."""
    listing = io.StringIO()
    if _run_suite(["--list"], listing):
        raise CLIError(f"`python -m {SUITE_MODULE} --list` failed; see the messages above")
    return [line.split()[0] for line in listing.getvalue().splitlines() if line.strip()]


def cmd_bench_suite(args: argparse.Namespace) -> Doc:
    import json
    import tempfile

    known = _known_suites()
    wanted = [] if args.suite == "all" else [n.strip() for n in args.suite.split(",")]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise CLIError(
            f"--suite {args.suite}: not a benchmark suite: {', '.join(unknown)} (the suites "
            f"of {SUITE_MODULE}: {', '.join(known)})"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.abspath(args.out) if args.out else os.path.join(tmp, "records.json")
        argv = ["--json", out]
        argv += ["--only", ",".join(wanted)] if wanted else []
        argv += ["--quick"] if args.quick else []
        argv += ["--no-save"] if args.no_save else []
        argv += [] if args.progress else ["--no-progress"]
        # --json output must stay one JSON document: the suite's table goes to stderr
        rc = _run_suite(argv, sys.stderr if args.json else sys.stdout)
        records = json.loads(Path(out).read_text()) if os.path.exists(out) else []
    doc: Doc = {
        "suite": args.suite,
        "quick": args.quick,
        "module": SUITE_MODULE,
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
    from kvstore.types import PutStatus

    size, count = args.size, args.count
    from kvstore.sdk.client import Client

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
        bar = render.Progress("put", count, enabled=args.progress)
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
        bar = render.Progress("get", len(keys), enabled=args.progress)
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
