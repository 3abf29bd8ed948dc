"""Fixtures of the fault and load suite: servers, and the results file behind docs/reliability.md.

Each scenario test calls ``record(...)`` with what it did (faults injected,
requests, fuzzed inputs) and what came of it (lost, wrong, recovery seconds).
At the end of the session the records are merged into the results file
(``$KVSTORE_FAULTS_RESULTS``, default ``tests/faults/.results.json``, not
committed) with each test's outcome; ``scripts/reliability_report.py`` turns
that file (and the soak's) into the table in ``docs/reliability.md``.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import make_server  # noqa: F401 - fixture re-exported

RESULTS = Path(os.environ.get("KVSTORE_FAULTS_RESULTS", Path(__file__).with_name(".results.json")))
_records: dict[str, dict[str, Any]] = {}
FIELDS = (
    "group",
    "scenario",
    "done",
    "faults",
    "requests",
    "fuzzed",
    "lost",
    "wrong",
    "recovery_s",
    "notes",
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome: Any = yield
    rep = outcome.get_result()
    if rep.when == "call" or rep.failed:
        for rec in _records.values():
            if rec["test"] == item.nodeid:
                rec["passed"] = rec.get("passed", True) and rep.passed


def _gone(nodeid: str) -> bool:
    """Whether the test that recorded a row no longer exists (renamed or removed)."""
    path, _, name = nodeid.partition("::")
    try:
        text = (Path(__file__).resolve().parents[2] / path).read_text()
    except OSError:
        return True
    return f"def {name.split('[')[0]}(" not in text


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _records:
        return
    try:
        data = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        data = {}
    ran = {rec["test"].split("[")[0] for rec in _records.values()}
    scenarios = {
        k: v
        for k, v in data.get("scenarios", {}).items()
        if v.get("test", "").split("[")[0] not in ran and not _gone(v.get("test", ""))
    }
    for rec in _records.values():
        scenarios[rec["id"]] = rec
    data["scenarios"] = scenarios
    data["updated"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[..., dict[str, Any]]:
    """record(group, scenario, done, faults=, requests=, fuzzed=, lost=, wrong=, recovery_s=,
    notes=): the row of this test in the reliability table (call it before the asserts, so a
    failing run still shows what went wrong)."""
    t0 = time.monotonic()

    def rec(group: str, scenario: str, done: str, **fields: Any) -> dict[str, Any]:
        unknown = set(fields) - set(FIELDS)
        assert not unknown, f"unknown result fields {unknown}"
        row: dict[str, Any] = {
            "id": f"{group}: {scenario}",
            "test": request.node.nodeid,
            "group": group,
            "scenario": scenario,
            "done": done,
            "faults": 0,
            "requests": 0,
            "fuzzed": 0,
            "lost": 0,
            "wrong": 0,
            "recovery_s": None,
            "notes": "",
            **fields,
        }
        row["seconds"] = round(time.monotonic() - t0, 1)
        if row["recovery_s"] is not None:
            row["recovery_s"] = round(float(row["recovery_s"]), 2)
        _records[request.node.nodeid + "::" + scenario] = row
        return row

    return rec


def arena_files() -> set[str]:
    """kvstore arena files in /dev/shm (a killed server must not leave its own behind)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("kvstore-")}
    except OSError:
        return set()
