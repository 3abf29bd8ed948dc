"""What vLLM shows of the connector: KV events, Prometheus counters, prefix-cache resets.

- One real vLLM engine (tests/connectors/observe_run.py), vLLM's prefix cache on, KV
  events published over ZMQ: the events a subscriber reads carry, for the chunks kvstore
  stored, medium CPU and exactly the block hashes vLLM's own KV cache manager published
  for those blocks (medium GPU); the ``vllm:kvstore_*`` counters in vLLM's Prometheus
  registry count the hits, loads and saves; ``reset_prefix_cache(reset_connector=True)``
  makes the next request compute (and store again), with the same output, and publishes
  ``AllBlocksCleared``.
- Without an engine: every counter the connector keeps has a Prometheus metric, and
  ``KVStorePromMetrics`` counts what it observes; a reset moves the scheduler half to a
  new key generation without deleting anything (another engine still loads).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvstore.connectors.vllm_observe import PROM_COUNTERS, KVStorePromMetrics, new_generation

import kvstore
from kvstore.testing.ports import free_port
from kvstore.testing.server import KVServer
from kvstore.testing.tinymodel import make_tiny_llama
from tests.connectors.halves import BS, Engine

REPO = Path(__file__).resolve().parents[2]
RUN = Path(__file__).with_name("observe_run.py")
TOL = 5e-3  # max |logprob difference| between loaded and recomputed KV (as the e2e tests)


def test_every_connector_counter_has_a_prometheus_metric() -> None:
    keys = set()
    for path in (REPO / "connectors").glob("vllm*.py"):
        for call in re.findall(r"stats\.add\(([^)]*)\)", path.read_text()):
            keys |= set(re.findall(r"(\w+)=", call))
    assert {"lookup_hits", "loaded_tokens", "save_s"} <= keys, f"the scan found too little: {keys}"
    missing = sorted(keys - PROM_COUNTERS.keys())
    assert not missing, f"connector counters without a vllm:kvstore_* metric: {missing}"


def test_prom_metrics_count_what_they_observe() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    types: dict[type, Any] = {
        t: functools.partial(t, registry=reg) for t in (Counter, Gauge, Histogram)
    }
    cfg = SimpleNamespace(kv_transfer_config=None)
    m = KVStorePromMetrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    m.observe({"hit_tokens": 512, "load_s": 0.25, "errors": 0, "unknown_key": 3}, 0)
    m.observe({"hit_tokens": 256, "load_s": 0.5}, 0)
    m.observe({"saved_tokens": 1024}, 1)

    def value(name: str, engine: str) -> float | None:
        return reg.get_sample_value(f"{name}_total", {"model_name": "m", "engine": engine})

    assert value("vllm:kvstore_hit_tokens", "0") == 768
    assert value("vllm:kvstore_load_seconds", "0") == 0.75
    assert value("vllm:kvstore_saved_tokens", "1") == 1024
    assert value("vllm:kvstore_saved_tokens", "0") is None  # never observed for engine 0
    assert value("vllm:kvstore_errors", "0") is None  # zero is not counted as an event


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KVServer]:
    s = KVServer(tmp_path, "observe", memory="128MiB").start()
    yield s
    assert s.stop() == 0, s.log()


def test_reset_moves_the_scheduler_to_a_new_generation(server: KVServer) -> None:
    """After a reset, this engine looks up and stores in a new generation: what it stored
    before is not loaded again (by it), nothing is deleted (another engine still loads)."""
    prompt = list(range(100, 100 + 4 * BS))
    engine, other = Engine(server.unix_url), Engine(server.unix_url)
    try:
        engine.step([(prompt, list(range(4)))])
        (hit,) = engine.step([(prompt, list(range(10, 14)))])
        assert hit.told > 0, "the stored prompt must hit before the reset"
        engine.scheduler.reset_cache(new_generation())
        (miss,) = engine.step([(prompt, list(range(20, 24)))])
        (again,) = engine.step([(prompt, list(range(30, 34)))])
        (theirs,) = other.step([(prompt, list(range(40, 44)))])
        with kvstore.Client(server.unix_url) as kv:
            salts = sorted(n.namespace.salt for n in kv.namespaces() if n.namespace)
    finally:
        engine.close()
        other.close()
    assert miss.told == 0, f"the reset engine loaded {miss.told} tokens stored before the reset"
    assert again.told == hit.told, "the prompt computed after the reset must be stored and hit"
    assert theirs.told == hit.told, "another engine's view must not change: nothing is deleted"
    assert any(s.startswith("gen:") for s in salts), f"no namespace of the new generation: {salts}"


# -- one engine: events and metrics as vLLM publishes them ------------------------------------


def test_events_metrics_and_reset_read_back_from_vllm(tmp_path: Path, server: KVServer) -> None:
    make_tiny_llama(tmp_path / "model")
    import random

    rng = random.Random(13)
    prompt = [rng.randrange(10, 1000) for _ in range(600)]  # 4 whole 128-token blocks + 88
    spec = {
        "model": str(tmp_path / "model"),
        "prompt": prompt,
        "events_port": free_port(),
        "kv_transfer_config": {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": server.unix_url, "retry_after_ms": 500},
        },
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    log = tmp_path / "engine.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(RUN), "--spec", str(tmp_path / "spec.json")]
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(
            [*cmd, "--out", str(tmp_path / "out.json")],
            stdout=f, stderr=subprocess.STDOUT, env=env, timeout=900, check=False,
        ).returncode  # fmt: skip
    assert rc == 0, f"engine failed (rc={rc}):\n{log.read_text()[-6000:]}"
    out = json.loads((tmp_path / "out.json").read_text())
    phases, events, metrics = out["phases"], out["events"], out["metrics"]
    seconds = time.monotonic() - t0

    # Outputs: loaded, recomputed after the reset, loaded again: all the same.
    for i, p in enumerate(phases[1:], start=2):
        assert p["token_ids"] == phases[0]["token_ids"], f"phase {i} generated other tokens"
        worst = max(
            abs(lp - dict(map(tuple, w))[t])
            for g, w in zip(p["logprobs"], phases[0]["logprobs"], strict=True)
            for t, lp in g
            if t in dict(map(tuple, w))
        )
        assert worst < TOL, f"phase {i} logprobs differ by {worst}"
    cached = [p["num_cached_tokens"] for p in phases]
    assert cached == [0, 512, 0, 512], (
        f"cached tokens per phase {cached}: store, load, computed after the connector's "
        "reset, load of what was stored after it"
    )

    # Events: kvstore's stores carry vLLM's own hashes for the same blocks.
    def stored(phase: list[dict[str, Any]], medium: str) -> list[Any]:
        return [
            h for e in phase if e["type"] == "BlockStored" and e["medium"] == medium
            for h in e["block_hashes"]
        ]  # fmt: skip

    gpu = stored(events[0], "GPU")
    assert len(gpu) >= 4, f"vLLM published no GPU BlockStored for the prompt: {events[0]}"
    for phase in (0, 2):
        ours = stored(events[phase], "CPU")
        assert ours == gpu[:4], (
            f"phase {phase + 1}: kvstore's BlockStored hashes {ours} are not vLLM's {gpu[:4]}"
        )
    assert not stored(events[1], "CPU") and not stored(events[3], "CPU"), (
        "a load stores nothing new: no CPU BlockStored expected"
    )
    first = next(e for e in events[0] if e["type"] == "BlockStored" and e["medium"] == "CPU")
    assert (first["parent"], first["block_size"], first["tokens"]) == (None, 128, 512), first
    cleared = [sum(e["type"] == "AllBlocksCleared" for e in p) for p in events]
    assert cleared[2] >= 2, f"the connector's reset must add AllBlocksCleared to vLLM's: {cleared}"
    assert cleared[1] == cleared[3] == 1, f"a local reset is vLLM's alone: {cleared}"

    # Metrics: vLLM's Prometheus registry has the connector's counters.
    m = {k.removeprefix("vllm:"): v for k, v in metrics.items()}
    assert m.get("kvstore_hit_tokens") == 1024, m
    assert m.get("kvstore_loaded_tokens") == 1024, m
    assert m.get("kvstore_saved_tokens") == 1024, m
    assert m.get("kvstore_lookup_hits") == 2 and m.get("kvstore_lookup_misses") == 2, m
    assert m.get("kvstore_load_seconds", 0) > 0 and m.get("kvstore_save_seconds", 0) > 0, m
    assert m.get("kvstore_lookup_seconds", 0) > 0, f"the lookups are timed: {m}"
    assert m.get("external_prefix_cache_hits", 0) >= 1024, m
    assert not m.get("kvstore_errors") and not m.get("kvstore_load_failed_blocks"), m
    assert seconds < 900
