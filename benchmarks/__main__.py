"""``python -m benchmarks``: run the benchmark suites and report ratios to limits.

    python -m benchmarks --quick --json out.json  # CI: small sizes, no vLLM suites (< 3 min)
    python -m benchmarks                          # everything, full size (45-60 min on 2 cores):
                                                  # RESULTS.md, plots/*.png, results/results.json
    python -m benchmarks --only remote,server     # some suites, merged into those files
    python -m benchmarks --only replay --quick    # a vLLM suite, small
    python -m benchmarks.plots out.json --out DIR # plots again from a JSON

Installed with kvstore, the same suite is ``kvstore.benchmarks``: ``python -m
kvstore.benchmarks ...`` (what ``kvstore bench --suite`` runs) from any directory.

A suite is a module in ``SUITES`` exposing
``run(quick: bool, progress: harness.Progress) -> list[harness.Record]``;
adding one is one line here. ``--quick`` leaves out the suites that start vLLM
engines (``VLLM_SUITES``: about a minute per engine to start on this machine)
unless ``--only`` names them. Timings never fail the run: the exit status is
non-zero only when a suite breaks (an exception, wrong bytes delivered).

A full run merges its records into ``results/results.json`` (replacing the records
of the suites it ran, keeping the others) and regenerates ``RESULTS.md`` and
``plots/*.png`` from that file, all in ``harness.output_dir()``: ``benchmarks/`` in
the source checkout (an editable install included), ``./kvstore-bench/`` under the
current directory for an installed copy (never site-packages).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .harness import (
    OUTPUT_DIR,
    PACKAGE,
    Record,
    checkout_of,
    machine_info,
    make_progress,
    markdown,
    module,
    output_dir,
    record_from_json,
    results_markdown,
    write_json,
)

# name -> module. Order is the order they run in.
SUITES: dict[str, str] = {
    "store": module("store"),
    "remote": module("remote"),
    "server": module("server_bench"),
    "concurrency": module("concurrency"),
    "connector": module("connector"),
    "replay": module("replay"),
    "serving": module("serving"),
    "serving_cores": module("serving_cores"),
}
VLLM_SUITES = ("connector", "replay", "serving", "serving_cores")

OUT = output_dir()  # benchmarks/ in the checkout, ./kvstore-bench/ for an installed copy
DEFAULT_MARKDOWN = OUT / "RESULTS.md"
RESULTS_JSON = OUT / "results" / "results.json"
PLOTS = OUT / "plots"
EXTRA_PLOTS = ("connector_ttft.png",)  # drawn by their suite, not by benchmarks.plots
IN_CHECKOUT = checkout_of() is not None
SHOWN = "benchmarks" if IN_CHECKOUT else OUTPUT_DIR  # OUT as the help and RESULTS.md name it
INTRO = (
    f"Written by `python -m {PACKAGE}` (full mode) from `{SHOWN}/results/results.json`; "
    "do not edit by hand. Every ratio is value / limit, the limit measured in the same run "
    "on the same bytes, interleaved with the case (this machine is shared and noisy: compare "
    "ratios, not values). Targets are goals from the issues, not pass/fail. What each case "
    "measures and how to read it: "
    + ("[docs/performance.md](../docs/performance.md)." if IN_CHECKOUT else
       "docs/performance.md in kvstore's source repository.")
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--only", metavar="NAME[,NAME]", help=f"run only these suites (of: {', '.join(SUITES)})"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"small sizes, few repetitions, no {' or '.join(VLLM_SUITES)} unless --only names it",
    )
    ap.add_argument("--json", metavar="FILE", help="write this run's records as a JSON list")
    ap.add_argument(
        "--markdown",
        metavar="PATH",
        help="write this run's records as a Markdown table (a full run also regenerates "
        f"{SHOWN}/RESULTS.md)",
    )
    ap.add_argument(
        "--no-save",
        action="store_true",
        help=f"full mode: leave {SHOWN}/results/results.json, RESULTS.md and the plots alone",
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help=f"run nothing: regenerate {SHOWN}/RESULTS.md and the plots from results/results.json",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--list", action="store_true", help="list the suites and exit")
    return ap.parse_args(argv)


def select(only: str | None, quick: bool = False) -> tuple[list[str], list[str]]:
    """The suites to run, and those a quick run leaves out."""
    if not only:
        if quick:
            return [n for n in SUITES if n not in VLLM_SUITES], list(VLLM_SUITES)
        return list(SUITES), []
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(SUITES)}")
    return names, []


def _load() -> str:
    """The 1/5/15-minute load averages: how busy the shared machine was when a suite began."""
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return ""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def run_suites(
    names: list[str], quick: bool, progress_on: bool = True
) -> tuple[list[Record], list[str], dict[str, dict[str, Any]]]:
    """Records of every suite that ran, the names of those that failed, and each run's facts."""
    progress = make_progress(progress_on)
    records: list[Record] = []
    failed: list[str] = []
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        start = time.monotonic()
        mode = "quick" if quick else "full"
        print(f"[{name}] {mode} run", file=sys.stderr, flush=True)
        runs[name] = {"mode": mode, "date": _now(), "load": _load()}
        try:
            suite = importlib.import_module(SUITES[name])
            got = suite.run(quick, progress)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            runs[name]["skipped"] = "FAILED"
            continue
        for r in got:
            r.suite = r.suite or name
        records += got
        runs[name]["seconds"] = round(time.monotonic() - start, 1)
        print(f"[{name}] {len(got)} records in {runs[name]['seconds']}s", file=sys.stderr,
              flush=True)  # fmt: skip
    return records, failed, runs


def save_full(
    records: list[Record], runs: dict[str, dict[str, Any]], machine: dict[str, str] | None
) -> list[Path]:
    """Merge into results.json; regenerate RESULTS.md and the plots from it. Paths written.

    With nothing run (``--render``), the file's own machine line is kept.
    """
    from . import plots

    old: dict[str, Any] = {"machine": {}, "runs": {}, "records": []}
    if RESULTS_JSON.exists():
        old = json.loads(RESULTS_JSON.read_text())
    done = {n for n, r in runs.items() if "skipped" not in r}
    kept = [record_from_json(d) for d in old["records"] if d.get("suite") not in done]
    all_runs = {n: r for n, r in old["runs"].items() if n not in done}
    all_runs |= {n: r for n, r in runs.items() if n in done}
    all_records = kept + records
    order = {name: i for i, name in enumerate(SUITES)}
    all_runs = dict(sorted(all_runs.items(), key=lambda kv: order.get(kv[0], 99)))
    all_records.sort(key=lambda r: order.get(r.suite, 99))  # stable: keeps each suite's order
    machine = machine or old["machine"]
    RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)  # OUT too
    RESULTS_JSON.write_text(json.dumps({"machine": machine, "runs": all_runs,
                                        "records": [r.to_json() for r in all_records]},
                                       indent=1) + "\n")  # fmt: skip
    written = plots.make_all(all_records, PLOTS)
    pngs = [p.name for p in written] + [n for n in EXTRA_PLOTS if (PLOTS / n).exists()]
    text = results_markdown(all_records, machine, all_runs, [f"plots/{n}" for n in pngs], INTRO)
    DEFAULT_MARKDOWN.write_text(text)
    return [RESULTS_JSON, DEFAULT_MARKDOWN, *written]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(f"{n}{' (vLLM)' if n in VLLM_SUITES else ''}" for n in SUITES))
        return 0
    if args.render:
        for path in save_full([], {}, None):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    names, left_out = select(args.only, args.quick)
    if left_out:
        print(f"quick mode: leaving out the vLLM suites {', '.join(left_out)} (an engine takes "
              f"about a minute to start here); run them with --only {','.join(left_out)}",
              file=sys.stderr)  # fmt: skip
    records, failed, runs = run_suites(names, args.quick, not args.no_progress)
    machine = machine_info()
    if args.json:
        write_json(records, args.json)
    mode = "quick" if args.quick else "full"
    text = markdown(records, machine, f"Benchmark results ({', '.join(names)}; {mode})")
    if left_out:
        text += f"\nLeft out in quick mode: {', '.join(left_out)} (vLLM engines).\n"
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)
    if not args.quick and not args.no_save:
        for path in save_full(records, runs, machine):
            print(f"wrote {path}", file=sys.stderr)
    if failed:
        print(f"failed suites: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
