"""The layers hold at run time too: a client loads no engine module, the package no tests/.

``lint-imports`` (CI's gate, contracts in pyproject.toml) checks every import statement;
this checks what a process really loads, lazy imports and the root package included.
"""

from __future__ import annotations

import json
import subprocess
import sys

ENGINE = (
    "kvstore.engine.store",
    "kvstore.engine.index",
    "kvstore.engine.lookup",
    "kvstore.engine.writer",
    "kvstore.engine.fallback",
    "kvstore.engine.tiers",
)


def _loaded(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return list(json.loads(out.splitlines()[-1]))


def test_a_client_loads_no_engine_module() -> None:
    loaded = _loaded("import kvstore; kvstore.Client; kvstore.AsyncClient; import kvstore.cli.main")
    engine = [m for m in loaded if m.startswith(ENGINE)]
    assert not engine, f"importing the SDK loaded the engine: {engine}"
    assert "lmdb" not in loaded and "redis" not in loaded, "the SDK loaded a tier's backend"


def test_the_package_loads_nothing_from_tests_or_benchmarks() -> None:
    loaded = _loaded(
        "import kvstore.cli.main, kvstore.server.main, kvstore.connectors.vllm_config, "
        "kvstore.testing.server, kvstore.testing.redis, kvstore.testing.mix"
    )
    outside = [
        m
        for m in loaded
        if m.split(".")[0] in ("tests", "benchmarks") or m.startswith("kvstore.benchmarks")
    ]
    assert not outside, f"the package imported {outside}"
