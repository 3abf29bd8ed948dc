"""``kvstore bench --suite``: the checkout's benchmark suite, run without importing it.

The suites live in the repository's ``benchmarks/`` folder, which is not
installed. The CLI runs ``python -m benchmarks`` as a child process in the
checkout it is started from, and outside a checkout it says that the suites need
one. Each test runs the CLI as its own process, as a user does, and checks that
the CLI process itself never imported ``benchmarks`` (before issue 17 it put the
checkout on ``sys.path`` and imported it, also from outside the checkout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# main() of the installed CLI, then a check that this process never imported the suite.
_CLI = (
    "import sys\n"
    "from kvstore.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "leaked = sorted(m for m in sys.modules if m == 'benchmarks' or m.startswith('benchmarks.'))\n"
    "print('imported:', leaked, file=sys.stderr)\n"
    "sys.exit(rc if not leaked else 99)\n"
)


def kvstore_cli(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CLI, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )


def test_outside_a_checkout_it_says_the_suites_need_one(tmp_path: Path) -> None:
    r = kvstore_cli(tmp_path, "bench", "--suite", "store", "--quick", "--no-save")
    assert r.returncode == 1, f"exit {r.returncode}, expected 1:\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    assert "source checkout" in r.stderr and "python -m benchmarks" in r.stderr, r.stderr
    assert str(tmp_path) in r.stderr, f"the message should name where it looked: {r.stderr}"


def test_an_unknown_suite_is_named_with_the_known_ones() -> None:
    r = kvstore_cli(ROOT, "bench", "--suite", "store,nope")
    assert r.returncode == 1, f"exit {r.returncode}, expected 1:\n{r.stdout}\n{r.stderr}"
    assert "not a benchmark suite: nope" in r.stderr, r.stderr
    assert "store, remote, server" in r.stderr, f"the known suites should be listed: {r.stderr}"


@pytest.mark.timeout(300)
def test_runs_the_suite_of_the_checkout_it_is_started_in(tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    # From a folder inside the checkout, with --out relative to where the user is.
    r = kvstore_cli(
        ROOT / "docs",
        "bench",
        "--suite",
        "store",
        "--quick",
        "--no-save",
        "--no-progress",
        "--json",
        "--out",
        os.path.relpath(out, ROOT / "docs"),
    )
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stdout}\n{r.stderr[-3000:]}"
    try:
        doc = json.loads(r.stdout)
    except ValueError as e:
        raise AssertionError(f"--json printed no single JSON document: {r.stdout!r}") from e
    assert (doc["suite"], doc["quick"], doc["checkout"]) == ("store", True, str(ROOT)), doc
    names = [rec["name"] for rec in doc["records"]]
    assert any(n.startswith("l1.") for n in names) and any(n.startswith("lookup") for n in names), (
        names
    )
    assert {rec["suite"] for rec in doc["records"]} == {"store"}, "only the store suite ran"
    assert json.loads(out.read_text()) == doc["records"], "--out must hold the same records"
    assert "| suite | case |" in r.stderr, "with --json the suite's table goes to stderr"
