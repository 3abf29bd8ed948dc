"""``kvstore bench --suite``: the checkout's benchmark suite, run without importing it.

The suites live in the repository's ``benchmarks/`` folder, which is not
installed. The CLI runs ``python -m benchmarks`` as a child process in the
checkout it is started from (or, for an editable install, in the package's own
checkout: tests/test_benchmarks.py runs that from a temp dir); an installed
package outside a checkout says that the suites need one. Each test runs the CLI
as its own process, as a user does, and checks that the CLI process itself never
imported ``benchmarks`` (before issue 17 it put the checkout on the import path
and imported it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# main() of the CLI, then a check that this process never imported the suite.
_CLI = (
    "import sys\n"
    "import kvstore\n"
    "from kvstore.cli.main import main\n"
    "print('kvstore from:', kvstore.__file__, file=sys.stderr)\n"
    "rc = main(sys.argv[1:])\n"
    "leaked = sorted(m for m in sys.modules if m == 'benchmarks' or m.startswith('benchmarks.'))\n"
    "print('imported:', leaked, file=sys.stderr)\n"
    "sys.exit(rc if not leaked else 99)\n"
)


def kvstore_cli(
    cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CLI, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )


def installed_copy(site: Path) -> Path:
    """The package laid out in ``site`` as a regular (not editable) install lays it out."""
    skip = shutil.ignore_patterns("__pycache__", "csrc")
    shutil.copytree(ROOT / "kvstore", site / "kvstore", ignore=skip)
    shutil.copytree(ROOT / "server", site / "kvstore" / "server", ignore=skip)
    shutil.copytree(ROOT / "connectors", site / "kvstore" / "connectors", ignore=skip)
    return site


def test_an_installed_kvstore_outside_a_checkout_says_the_suites_need_one(tmp_path: Path) -> None:
    site = installed_copy(tmp_path / "site-packages")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = kvstore_cli(elsewhere, "bench", "--suite", "store", "--quick", "--no-save", env=env)
    assert f"kvstore from: {site}" in r.stderr, f"the installed copy was not used: {r.stderr}"
    assert r.returncode == 1, f"exit {r.returncode}, expected 1:\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    assert "source checkout" in r.stderr and "python -m benchmarks" in r.stderr, r.stderr
    assert str(elsewhere) in r.stderr, f"the message should name where it looked: {r.stderr}"


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
