"""``kvstore bench --suite``: the installed benchmark suite, run without importing it.

The suites are the repository's ``benchmarks/`` folder, installed with the package as
``kvstore.benchmarks`` (as ``server/`` is ``kvstore.server``). The CLI runs ``python -m
kvstore.benchmarks`` as a child process in the current directory, with or without a
source checkout around it. Each test runs the CLI as its own process, as a user does,
and checks that the CLI process itself never imported the suite (before issue 17 it put
the checkout on the import path and imported it). Where a run writes its files is the
suite's decision (``harness.output_dir``): beside the suite in a checkout, else
``./kvstore-bench/``, never into site-packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import OUTPUT_DIR, checkout_of, output_dir

ROOT = Path(__file__).resolve().parent.parent

# main() of the CLI, then a check that this process never imported the suite.
_CLI = (
    "import sys\n"
    "import kvstore\n"
    "from kvstore.cli.main import main\n"
    "print('kvstore from:', kvstore.__file__, file=sys.stderr)\n"
    "rc = main(sys.argv[1:])\n"
    "leaked = sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks'\n"
    "                or m == 'kvstore.benchmarks' or m.startswith('kvstore.benchmarks.'))\n"
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
    """The package laid out in ``site`` as a regular (not editable) install lays it out:
    the suite's modules only (``include-package-data = false``), no results or plots."""
    skip = shutil.ignore_patterns("__pycache__", "csrc")
    shutil.copytree(ROOT / "kvstore", site / "kvstore", ignore=skip)
    shutil.copytree(ROOT / "server", site / "kvstore" / "server", ignore=skip)
    shutil.copytree(ROOT / "connectors", site / "kvstore" / "connectors", ignore=skip)
    shutil.copytree(
        ROOT / "benchmarks",
        site / "kvstore" / "benchmarks",
        ignore=shutil.ignore_patterns("__pycache__", "results", "plots", "*.md"),
    )
    return site


def test_the_output_dir_is_the_suite_in_a_checkout_else_kvstore_bench(tmp_path: Path) -> None:
    assert checkout_of(ROOT / "benchmarks") == ROOT
    assert output_dir(ROOT / "benchmarks", tmp_path) == ROOT / "benchmarks", "checkout: unchanged"
    site = tmp_path / "lib" / "python3.11" / "site-packages" / "kvstore" / "benchmarks"
    site.mkdir(parents=True)
    assert checkout_of(site) is None
    assert output_dir(site, tmp_path / "here") == tmp_path / "here" / OUTPUT_DIR
    # A folder named benchmarks/ in some other project is not kvstore's checkout either.
    (tmp_path / "lib" / "pyproject.toml").write_text("[project]\nname = 'other'\n")
    assert output_dir(tmp_path / "lib" / "benchmarks", tmp_path) == tmp_path / OUTPUT_DIR


def test_children_are_named_by_the_package_and_run_where_it_imports() -> None:
    code = (
        "import json, sys\n"
        "from importlib import import_module\n"
        "h = import_module(sys.argv[1] + '.harness')\n"
        "m = import_module(sys.argv[1] + '.__main__')\n"
        "print(json.dumps([h.module('ttft_driver'), m.SUITES['server'], str(h.child_cwd())]))\n"
    )

    def facts(package: str, cwd: Path) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", code, package],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return list(json.loads(out.stdout.splitlines()[-1]))

    assert facts("benchmarks", ROOT) == [
        "benchmarks.ttft_driver",
        "benchmarks.server_bench",
        str(ROOT),
    ]
    assert facts("kvstore.benchmarks", ROOT / "docs") == [
        "kvstore.benchmarks.ttft_driver",
        "kvstore.benchmarks.server_bench",
        "None",
    ]


def test_an_installed_copy_writes_its_results_under_the_current_directory(
    tmp_path: Path,
) -> None:
    """A regular install (no checkout around the suite): a full run's files go to
    ./kvstore-bench/, none into the package. ``--render`` writes them without running."""
    site = installed_copy(tmp_path / "site-packages")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import kvstore.benchmarks.harness as h; print(h.__file__); print(h.output_dir())"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    where, out = r.stdout.split()
    assert where.startswith(str(site)), f"the installed copy was not used: {where}"
    assert Path(out) == elsewhere / OUTPUT_DIR
    r = subprocess.run(
        [sys.executable, "-m", "kvstore.benchmarks", "--render"], cwd=elsewhere, env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (elsewhere / OUTPUT_DIR / "RESULTS.md").is_file(), r.stderr
    assert (elsewhere / OUTPUT_DIR / "results" / "results.json").is_file(), r.stderr
    assert "python -m kvstore.benchmarks" in (elsewhere / OUTPUT_DIR / "RESULTS.md").read_text()
    package = site / "kvstore" / "benchmarks"
    written = [p for p in package.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert not written, f"wrote into the package: {written}"


def test_an_installed_kvstore_outside_a_checkout_runs_its_own_suite(tmp_path: Path) -> None:
    site = installed_copy(tmp_path / "site-packages")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    # An unknown name: the child listed the suites of the installed copy, nothing ran.
    r = kvstore_cli(elsewhere, "bench", "--suite", "store,nope", env=env)
    assert f"kvstore from: {site}" in r.stderr, f"the installed copy was not used: {r.stderr}"
    assert r.returncode == 1, f"exit {r.returncode}, expected 1:\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    assert "not a benchmark suite: nope" in r.stderr, r.stderr
    assert "store, remote, server" in r.stderr, f"the known suites should be listed: {r.stderr}"
    assert "imported: []" in r.stderr, r.stderr
    assert list(elsewhere.iterdir()) == [], "nothing is written for a refused run"


def test_an_unknown_suite_is_named_with_the_known_ones() -> None:
    r = kvstore_cli(ROOT, "bench", "--suite", "store,nope")
    assert r.returncode == 1, f"exit {r.returncode}, expected 1:\n{r.stdout}\n{r.stderr}"
    assert "not a benchmark suite: nope" in r.stderr, r.stderr
    assert "store, remote, server" in r.stderr, f"the known suites should be listed: {r.stderr}"


@pytest.mark.timeout(300)
def test_runs_the_installed_suite_from_any_directory(tmp_path: Path) -> None:
    """No checkout around the current directory (about 10 s: the store suite, quick)."""
    here = tmp_path / "here"
    here.mkdir()
    out = here / "records.json"
    r = kvstore_cli(
        here,
        "bench",
        "--suite",
        "store",
        "--quick",
        "--no-progress",
        "--json",
        "--out",
        "records.json",  # relative to where the user is
    )
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stdout}\n{r.stderr[-3000:]}"
    try:
        doc = json.loads(r.stdout)
    except ValueError as e:
        raise AssertionError(f"--json printed no single JSON document: {r.stdout!r}") from e
    assert (doc["suite"], doc["quick"], doc["module"]) == ("store", True, "kvstore.benchmarks"), doc
    names = [rec["name"] for rec in doc["records"]]
    assert any(n.startswith("l1.") for n in names) and any(n.startswith("lookup") for n in names), (
        names
    )
    assert {rec["suite"] for rec in doc["records"]} == {"store"}, "only the store suite ran"
    assert json.loads(out.read_text()) == doc["records"], "--out must hold the same records"
    assert "| suite | case |" in r.stderr, "with --json the suite's table goes to stderr"
    assert "imported: []" in r.stderr, r.stderr
    assert sorted(p.name for p in here.iterdir()) == ["records.json"], "a quick run saves nothing"
