"""``python -m benchmarks``: run the benchmark suites and report ratios to limits.

    python -m benchmarks                          # every suite, full size; writes RESULTS.md
    python -m benchmarks --quick                  # every suite, small (the whole run < 3 min)
    python -m benchmarks --only store --quick --json out.json

A suite is a module in ``SUITES`` exposing
``run(quick: bool, progress: harness.Progress) -> list[harness.Record]``;
adding one is one line here. Timings never fail the run: the exit status is
non-zero only when a suite breaks (an exception, wrong bytes delivered).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from benchmarks.harness import Record, machine_info, make_progress, markdown, write_json

# name -> module. Order is the order they run in.
SUITES: dict[str, str] = {
    "store": "benchmarks.store",
    "server": "benchmarks.server_bench",
    "connector": "benchmarks.connector",
}

DEFAULT_MARKDOWN = Path(__file__).resolve().parent / "RESULTS.md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--only", metavar="NAME[,NAME]", help=f"run only these suites (of: {', '.join(SUITES)})"
    )
    ap.add_argument("--quick", action="store_true", help="small sizes and few repetitions")
    ap.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    ap.add_argument(
        "--markdown",
        metavar="PATH",
        help="write a Markdown table (default: benchmarks/RESULTS.md, full mode only)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--list", action="store_true", help="list the suites and exit")
    return ap.parse_args(argv)


def select(only: str | None) -> list[str]:
    if not only:
        return list(SUITES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(SUITES)}")
    return names


def run_suites(
    names: list[str], quick: bool, progress_on: bool = True
) -> tuple[list[Record], list[str]]:
    """Records of every suite that ran, and the names of those that failed."""
    progress = make_progress(progress_on)
    records: list[Record] = []
    failed: list[str] = []
    for name in names:
        start = time.monotonic()
        print(f"[{name}] {'quick' if quick else 'full'} run", file=sys.stderr, flush=True)
        try:
            suite = importlib.import_module(SUITES[name])
            got = suite.run(quick, progress)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        for r in got:
            r.suite = r.suite or name
        records += got
        print(
            f"[{name}] {len(got)} records in {time.monotonic() - start:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return records, failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(SUITES))
        return 0
    names = select(args.only)
    records, failed = run_suites(names, args.quick, not args.no_progress)
    machine = machine_info()
    if args.json:
        write_json(records, args.json)
    md_path = args.markdown or (None if args.quick else DEFAULT_MARKDOWN)
    mode = "quick" if args.quick else "full"
    text = markdown(records, machine, f"Benchmark results ({', '.join(names)}; {mode})")
    if md_path:
        Path(md_path).write_text(text)
    print(text)
    if failed:
        print(f"failed suites: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
