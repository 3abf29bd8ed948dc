"""Smoke test of the benchmark suite: it runs, and its records have the documented shape.

Nothing here looks at a timing: the machine is shared, figures are for reading.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.__main__ import SUITES, select
from benchmarks.harness import (
    RECORD_KEYS,
    PlainProgress,
    Record,
    interleaved,
    machine_info,
    write_markdown,
)

ROOT = Path(__file__).resolve().parent.parent
Run = tuple[list[dict[str, Any]], str]

# One of each kind of store case, so a renamed or dropped case is noticed.
EXPECTED = {
    "l1.tier.put.1MiB",
    "l1.store.put.8MiB",
    "l1.tier.get_into.8MiB",
    "l1.store.get_into.1MiB",
    "l2.get_into.1MiB",
    "l2.get_into.vs_lmdb.8MiB",
    "lookup.128k.p50",
    "lookup.128k.p99",
    "hash.chunk_keys.128k.p50",
    "lookup.p50.prompt=1k",
    "lookup.128k.p50.keys=100,000",
    "codec.zstd_shuffle.l1.compression",
    "codec.zstd.l3.decode",
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("bench")
    js, md = out / "out.json", out / "out.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--only",
            "store",
            "--quick",
            "--json",
            str(js),
            "--markdown",
            str(md),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"quick store run failed:\n{proc.stderr[-4000:]}"
    return json.loads(js.read_text()), md.read_text()


def test_quick_store_run_writes_records_of_the_documented_shape(quick_run: Run) -> None:
    records, _ = quick_run
    assert isinstance(records, list) and records, "--json must write a non-empty list"
    names = [r["name"] for r in records]
    assert len(names) == len(set(names)), f"duplicate record names: {names}"
    missing = EXPECTED - set(names)
    assert not missing, f"store cases missing from the quick run: {sorted(missing)}"
    for r in records:
        for key in RECORD_KEYS:
            assert key in r, f"record {r.get('name')} lacks {key!r}"
        assert isinstance(r["name"], str) and isinstance(r["unit"], str) and r["unit"], r
        assert isinstance(r["value"], (int, float)) and math.isfinite(r["value"]), r
        assert r["value"] > 0, f"{r['name']}: a measured figure must be positive, got {r}"
        assert r["suite"] == "store", f"{r['name']}: suite not recorded"
        if r["limit"] is None:
            assert r["ratio"] is None, f"{r['name']}: a ratio without a limit"
        else:
            assert r["limit"] > 0, r
            assert r["ratio"] == pytest.approx(r["value"] / r["limit"], rel=1e-9), (
                f"{r['name']}: ratio must be value / limit"
            )


def test_quick_store_run_writes_markdown_with_the_machine(quick_run: Run) -> None:
    records, md = quick_run
    assert "| suite | case | value | unit | limit | ratio |" in md, md[:500]
    assert "cpu " in md and "python " in md and "date " in md, "machine line missing"
    for r in records:
        assert f"| {r['name']} |" in md, f"{r['name']} missing from the Markdown table"


def test_interleaved_takes_turns_and_undoes_untimed() -> None:
    calls: list[str] = []
    t = interleaved(
        {
            "a": lambda: calls.append("a"),
            "b": (lambda: calls.append("b"), lambda: calls.append("undo")),
        },
        reps=5,
        warmup=2,
    )
    assert {k: len(v) for k, v in t.items()} == {"a": 5, "b": 5}, "warmup must not be recorded"
    assert calls.count("a") == 7 and calls.count("b") == 7, calls
    after_b = [calls[i + 1] for i, c in enumerate(calls) if c == "b"]
    assert after_b == ["undo"] * 7, f"undo must follow its case at once: {calls}"


def test_record_ratio_and_markdown(tmp_path: Path) -> None:
    assert Record("x", 2.0, "GB/s", 4.0).ratio == 0.5
    assert Record("y", 2.0, "x").ratio is None
    path = tmp_path / "r.md"
    write_markdown([Record("x", 2.0, "GB/s", 4.0, suite="s", notes="a | b")], path, machine_info())
    text = path.read_text()
    assert "| s | x | 2 | GB/s | 4 | 0.5 |" in text, text
    assert "a | b" in text and "cores " in text, text


def test_plain_progress_reports_each_phase() -> None:
    stream = io.StringIO()
    assert list(PlainProgress(stream=stream)(range(3), desc="phase")) == [0, 1, 2]
    assert "phase: 3 done" in stream.getvalue(), stream.getvalue()


def test_only_selects_known_suites() -> None:
    assert select(None) == list(SUITES) and select("store") == ["store"]
    with pytest.raises(SystemExit, match="unknown suite"):
        select("store,nope")
