#!/usr/bin/env python3
"""Regenerate the results table of docs/reliability.md from the fault suite and the soak.

    .venv/bin/python -m pytest tests/faults          # writes tests/faults/.results.json
    .venv/bin/python benchmarks/soak.py              # writes benchmarks/results/soak.json
    .venv/bin/python scripts/reliability_report.py   # rewrites the table in the doc

The table sits between the ``<!-- reliability:start -->`` and ``<!-- reliability:end -->``
markers; everything else in the document is left alone. ``--check`` exits 1 when the
document's table differs from what the results say (nothing is written), or when a
scenario lost or served wrong data, or failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- reliability:start -->", "<!-- reliability:end -->"
GROUPS = [
    "Crash",
    "Remote tier",
    "Capacity",
    "Clients",
    "Streams",
    "Operators",
    "Corruption",
    "Bad input",
    "Security",
    "Connector",
]


def _num(v: Any) -> str:
    return "" if v in (None, 0, "") else f"{v:,}" if isinstance(v, int) else str(v)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _recovery(v: Any) -> str:
    return "" if v is None else f"{v:.2f} s"


def rows(results: dict[str, Any], soak: dict[str, Any] | None) -> list[list[str]]:
    scenarios = list(results.get("scenarios", {}).values())
    order = {g: i for i, g in enumerate(GROUPS)}
    scenarios.sort(key=lambda r: (order.get(r["group"], len(order)), r["scenario"]))
    out = []
    for r in scenarios:
        ok = r.get("passed", False) and not r["lost"] and not r["wrong"]
        done = r["done"] + (f". *{r['notes']}*" if r.get("notes") else "")
        out.append(
            [
                r["group"],
                r["scenario"],
                done,
                _num(r["faults"]),
                _num(r["requests"]),
                _num(r["fuzzed"]),
                str(r["lost"]),
                str(r["wrong"]),
                _recovery(r.get("recovery_s")),
                "pass" if ok else "**FAIL**",
            ]
        )
    if soak:
        ok = (
            not soak["lost"]
            and not soak["wrong"]
            and not soak["errors"]
            and not soak["server_exit"]
        )
        done = (
            f"{soak['clients']} clients x {soak['minutes']} min of put/get/lookup/delete, "
            f"every read verified; {soak['kills']} x kill -9 and restart, "
            f"{soak['redis_outages']} x Redis stopped and started. *{soak['gets']:,} gets "
            f"({soak['hits']:,} hits), {soak['chunks_stored']:,} chunks stored, "
            f"{soak['found_after_crash']:,} chunks found again after the crashes, "
            f"{soak['volatile']} acknowledged but only in memory at a kill, "
            f"{soak['unavailable_calls']:,} calls refused while the server was down, "
            f"{soak['errors']} other errors; slowest call {soak['slowest_call_s']} s; "
            f"run {soak['date'][:10]}*"
        )
        kr, rr = soak["kill_recovery_s"], soak["redis_recovery_s"]
        recovery = (
            f"restart {kr['max']:.2f} s max ({kr['mean']:.2f} mean); Redis {rr['max']:.2f} s"
            if kr.get("mean") is not None
            else ""
        )
        out.append(
            [
                "Soak",
                "benchmarks/soak.py",
                done,
                _num(soak["faults"]),
                _num(soak["requests"]),
                "",
                str(soak["lost"]),
                str(soak["wrong"]),
                recovery,
                "pass" if ok else "**FAIL**",
            ]
        )
    return out


def table(results: dict[str, Any], soak: dict[str, Any] | None) -> str:
    head = [
        "Area",
        "Scenario",
        "What was done",
        "Faults",
        "Requests",
        "Fuzzed inputs",
        "Lost",
        "Wrong served",
        "Recovery",
        "Result",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows(results, soak):
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    stamp = results.get("updated", "never")
    lines.append("")
    lines.append(
        f"Suite results of {stamp[:16].replace('T', ' ')} UTC"
        + (
            f"; soak of {soak['date'][:16].replace('T', ' ')} UTC"
            if soak
            else "; the soak has not been run"
        )
        + ". Regenerate with "
        "`python scripts/reliability_report.py`."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--results", type=Path, default=ROOT / "tests" / "faults" / ".results.json")
    ap.add_argument("--soak", type=Path, default=ROOT / "benchmarks" / "results" / "soak.json")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "reliability.md")
    ap.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = ap.parse_args(argv)
    try:
        results = json.loads(args.results.read_text())
    except (OSError, ValueError) as e:
        print(
            f"reliability_report: cannot read {args.results}: {e} (run the fault suite: "
            "pytest tests/faults)",
            file=sys.stderr,
        )
        return 1
    soak = json.loads(args.soak.read_text()) if args.soak.exists() else None
    doc = args.doc.read_text()
    if START not in doc or END not in doc:
        print(f"reliability_report: {args.doc} lacks the {START} / {END} markers", file=sys.stderr)
        return 1
    before, rest = doc.split(START, 1)
    _, after = rest.split(END, 1)
    new = f"{before}{START}\n{table(results, soak)}\n{END}{after}"
    failed = [r for r in rows(results, soak) if r[-1] != "pass"]
    if args.check:
        if new != doc:
            print(f"{args.doc} is out of date: run scripts/reliability_report.py", file=sys.stderr)
            return 1
    else:
        args.doc.write_text(new)
        print(f"wrote the table of {len(rows(results, soak))} scenarios into {args.doc}")
    for r in failed:
        print(f"FAILED: {r[0]}: {r[1]} (lost {r[6]}, wrong {r[7]})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
