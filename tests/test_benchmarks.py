"""Smoke test of the benchmark suite: it runs, and its records have the documented shape.

The quick run here covers the store and remote suites (~10-20 s); the whole quick run
(``python -m benchmarks --quick``, ~40 s plus server start-ups) is CI's job, not pytest's.

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

from benchmarks.__main__ import SUITES, VLLM_SUITES, select
from benchmarks.harness import (
    RECORD_KEYS,
    KiB,
    LoopbackTcp,
    MiB,
    PlainProgress,
    Record,
    interleaved,
    machine_info,
    random_bytes,
    results_markdown,
    size_label,
    touched,
    write_markdown,
)
from benchmarks.replay import BLOCK, QUICK, conversation, ideal_hits
from kvstore.config import parse_size

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
    "l2.put.64KiB",
    "l3.redis.put.64KiB",
    "l3.valkey.get_into.4MiB",
    "l3.redis.raw_get.4MiB",
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
            "store,remote",
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
    assert proc.returncode == 0, f"quick store+remote run failed:\n{proc.stderr[-4000:]}"
    return json.loads(js.read_text()), md.read_text()


def test_quick_run_writes_records_of_the_documented_shape(quick_run: Run) -> None:
    records, _ = quick_run
    assert isinstance(records, list) and records, "--json must write a non-empty list"
    names = [r["name"] for r in records]
    assert len(names) == len(set(names)), f"duplicate record names: {names}"
    missing = EXPECTED - set(names)
    assert not missing, f"cases missing from the quick run: {sorted(missing)}"
    for r in records:
        for key in RECORD_KEYS:
            assert key in r, f"record {r.get('name')} lacks {key!r}"
        assert isinstance(r["name"], str) and isinstance(r["unit"], str) and r["unit"], r
        assert isinstance(r["value"], (int, float)) and math.isfinite(r["value"]), r
        assert r["value"] > 0, f"{r['name']}: a measured figure must be positive, got {r}"
        suite = "remote" if r["name"].startswith("l3.") else "store"
        assert r["suite"] == suite, f"{r['name']}: suite {r['suite']!r}, expected {suite!r}"
        if r["limit"] is None:
            assert r["ratio"] is None, f"{r['name']}: a ratio without a limit"
        else:
            assert r["limit"] > 0, r
            assert r["ratio"] == pytest.approx(r["value"] / r["limit"], rel=1e-9), (
                f"{r['name']}: ratio must be value / limit"
            )


def test_quick_run_writes_markdown_with_the_machine(quick_run: Run) -> None:
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


def test_only_selects_known_suites_and_quick_leaves_out_vllm() -> None:
    assert select(None) == (list(SUITES), []), "a full run runs every suite"
    assert select("store") == (["store"], [])
    names, left_out = select(None, quick=True)
    assert left_out == list(VLLM_SUITES) and not set(names) & set(VLLM_SUITES), (names, left_out)
    assert select("replay", quick=True) == (["replay"], []), "--only must run a vLLM suite"
    with pytest.raises(SystemExit, match="unknown suite"):
        select("store,nope")


def test_size_labels_round_trip() -> None:
    for n in (64 * KiB, 256 * KiB, MiB, 64 * MiB, 1000):
        assert parse_size(size_label(n)) == n, size_label(n)
    assert size_label(64 * KiB) == "64KiB" and size_label(4 * MiB) == "4MiB"


def test_loopback_tcp_moves_the_bytes() -> None:
    n = 3 * MiB + 5
    src, dst = random_bytes(n, 1), touched(n, 0)
    with LoopbackTcp() as tcp:
        tcp.put(src)
        tcp.get_into(dst)
        tcp.get_into(dst)  # the second read comes from the server's cached buffer
    expected = random_bytes(n, n)  # what the server sends: seeded by the size
    assert (dst == expected).all(), "get_into must fill the whole buffer with the server's bytes"


def test_replay_workload_shares_prefixes_as_a_chat_does() -> None:
    rounds = conversation(QUICK)
    assert len(rounds) == QUICK.rounds and all(len(r) == QUICK.users for r in rounds)
    system = rounds[0][0][: QUICK.system_tokens]
    for row in rounds:
        for tokens in row:
            assert tokens[: QUICK.system_tokens] == system, "every prompt starts with the system"
    for u in range(QUICK.users):
        prev, cur = rounds[0][u], rounds[1][u]
        assert cur[: len(prev)] == prev and len(cur) > len(prev), "a history must grow"
    order = [t for row in rounds for t in row]
    ideal = ideal_hits(order)
    assert ideal[0] == 0, "the first prompt has nothing to reuse"
    assert ideal[1] == QUICK.system_tokens // BLOCK * BLOCK, ideal
    assert all(
        (h % BLOCK == 0 or h == len(t) - 1) and h < len(t)
        for h, t in zip(ideal, order, strict=True)
    ), ideal


def test_results_markdown_has_runs_plots_and_one_table_per_suite() -> None:
    recs = [
        Record("a.x", 1.0, "GB/s", 2.0, suite="s1", notes="shared"),
        Record("a.y", 3.0, "GB/s", 2.0, suite="s1", notes="shared"),
        Record("b", 0.5, "s", suite="s2"),
    ]
    runs: dict[str, dict[str, Any]] = {
        "s1": {"mode": "full", "date": "d", "seconds": 3.0},
        "s2": {"skipped": "FAILED"},
    }
    text = results_markdown(recs, machine_info(), runs, ["plots/t.png"], "intro")
    assert "## s1" in text and "## s2" in text and "![t](plots/t.png)" in text, text
    assert "| s2 | FAILED |" in text, "a failed suite must show in the runs table"
    assert "- `a.x`, `a.y`: shared" in text, "a note shared by records is written once"


def test_plots_draw_each_family_from_records(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import plots

    recs: list[Record] = []
    for n in (64 * KiB, MiB):
        lab = size_label(n)
        recs += [Record(f"l1.tier.put.{lab}", 1.0, "GB/s", 2.0),
                 Record(f"l3.redis.get_into.{lab}", 0.2, "GB/s", 0.4),
                 Record(f"server.shm.put.{lab}", 1.0, "GB/s", 4.0),
                 Record(f"server.grpc.get.{lab}", 0.3, "GB/s", 0.5)]  # fmt: skip
    for c in (1, 2):
        recs += [Record(f"concurrency.put.clients={c}", 1.0, "GB/s", 5.0),
                 Record(f"concurrency.get.clients={c}", 2.0, "GB/s", 5.0)]  # fmt: skip
    recs += [Record("lookup.p50.prompt=1k", 0.05, "ms", 0.03),
             Record("lookup.128k.p50.keys=1,000", 4.0, "ms", 2.0),
             Record("replay.ttft.mean.round=1", 0.5, "s", 1.0),
             Record("replay.hit_rate.with_kvstore", 0.5, "fraction", 0.6)]  # fmt: skip
    for stat in ("mean", "p90"):
        recs += [Record(f"replay.ttft.{stat}.with_kvstore", 0.5, "s", 1.0),
                 Record(f"replay.ttft.{stat}.without_kvstore", 1.0, "s")]  # fmt: skip
    written = plots.make_all(recs, tmp_path)
    assert sorted(p.name for p in written) == sorted(plots.FAMILIES), written
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{p} is not a PNG"
    assert plots.make_all([Record("other", 1.0, "x")], tmp_path / "none") == [], (
        "a family without records must be skipped"
    )


def test_kvstore_bench_suite_runs_the_same_suite(tmp_path: Path) -> None:
    """`kvstore bench --suite` is `python -m benchmarks`, found from any directory."""
    js = tmp_path / "records.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "--json", "bench", "--suite", "store", "--quick",
         "--no-save", "--no-progress", "--out", str(js)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, f"kvstore bench --suite failed:\n{proc.stderr[-3000:]}"
    doc = json.loads(proc.stdout)  # the suite's own table must not leak into --json output
    assert doc["suite"] == "store" and doc["quick"] is True
    names = {r["name"] for r in doc["records"]}
    assert "lookup.128k.p50" in names, f"store suite records missing: {sorted(names)[:10]}"
    assert all(set(RECORD_KEYS) <= set(r) for r in doc["records"]), "records lack documented keys"
    assert json.loads(js.read_text()) == doc["records"], "--out holds other records"


def test_the_serving_report_pairs_kvstore_with_both_engines_alone_by_seed() -> None:
    """store_on_miss's limit is the mean of the two engines alone in the same turn (the
    same seed), never a run of another seed; the per-set medians name each set."""
    from benchmarks.serving_report import by_block, paired, with_pooled

    def run(seed: int, block: int, rps: float) -> dict[str, Any]:
        return {"seed": seed, "block": block, "request_throughput": rps}

    runs = with_pooled({
        "alone.random": [run(1, 0, 8.0), run(2, 1, 6.0), run(3, 1, 9.0)],
        "alone2.random": [run(2, 1, 10.0), run(1, 0, 10.0)],  # no run of seed 3
        "kv.random": [run(1, 0, 8.1), run(2, 1, 7.2), run(3, 1, 9.0)],
    })  # fmt: skip
    both = runs["alone.both"]
    assert [(r["seed"], r["block"], r["request_throughput"]) for r in both] == [
        (1, 0, 9.0),
        (2, 1, 8.0),
    ], "each seed's two runs alone, averaged; a seed one engine did not run is left out"
    ratios = paired(runs["kv.random"], both, "request_throughput")
    assert ratios == pytest.approx([0.9, 0.9]), ratios
    got = by_block(runs["kv.random"], both, "request_throughput")
    assert got.endswith("0.900, 0.900"), got
    single = with_pooled({"alone.random": [run(1, 0, 8.0)]})
    alone = single["alone.random"]
    assert single["alone.both"] == alone, "with no second engine alone, the first's runs"


def test_the_serving_report_pairs_both_cache_on_kinds_with_both_engines_alone() -> None:
    """(b) and the restart (e) are read against the mean of the two engines alone with
    vLLM's prefix cache on, and the cache-on control (the second alone against the first)
    is reported: one engine alone is one draw of an engine's own lasting speed."""
    from benchmarks.serving import QUICK as SERVE
    from benchmarks.serving_report import records, table

    def run(seed: int, block: int, rps: float, ttft: float = 100.0) -> dict[str, Any]:
        return {"seed": seed, "block": block, "request_throughput": rps, "mean_ttft_ms": ttft,
                "mean_tpot_ms": 10.0, "median_ttft_ms": ttft, "duration": 4.0}  # fmt: skip

    on = {
        "alone": [run(1, 0, 8.0), run(2, 1, 10.0)],
        "alone2": [run(1, 0, 12.0, 300.0), run(2, 1, 10.0, 300.0)],
        "kv": [run(1, 0, 9.5), run(2, 1, 9.5)],
        "kv2.restart": [run(1, 0, 9.0, 10.0), run(2, 0, 9.0, 20.0)],
    }
    other = {
        name: [run(7, 0, 5.0)]
        for name in ("alone.nocache", "kv.nocache", "alone.random", "kv.random")
    }
    res = {"runs": on | other}
    got = {r.name: r for r in records(SERVE, res)}
    rps = got["serving.cache_on.request_throughput"]
    assert rps.ratio == pytest.approx(0.95), (
        f"(b) against the mean of alone and alone2 per seed (10 and 10) is 0.95: {rps}"
    )
    assert "by set of engines (each started anew): 0.950, 0.950" in rps.notes, (
        f"both sets' medians named: {rps.notes}"
    )
    control = got["serving.cache_on.control.request_throughput"]
    assert control.ratio == pytest.approx(1.25), f"alone2 / alone: 1.5 and 1.0: {control}"
    assert "serving.store_on_miss.control.request_throughput" not in got, (
        "no second engine alone ran the no-reuse runs: no control for them"
    )
    restart = got["serving.restart.mean_ttft"]
    assert restart.ratio == pytest.approx(0.075), (
        f"10 and 20 ms against both cold engines' mean (100 and 300 ms: 200): {restart}"
    )
    assert "a second engine alone, cache on (control)" in table(SERVE, res)


def test_serving_cores_gives_the_server_the_last_cpu_and_pairs_as_serving_does() -> None:
    """The engines compute on every CPU but the highest, which the kvstore-server gets; a
    host where that cannot be said as one range runs nothing. The records pair the kvstore
    engine with both engines alone, as the serving suite's do."""
    from benchmarks.serving import QUICK as SERVE
    from benchmarks.serving_cores import records, split_cpus

    assert split_cpus({0, 1}) == ("0-0", 1)
    assert split_cpus({4, 5, 6, 7}) == ("4-6", 7)
    assert split_cpus({0}) is None, "one CPU: nothing to give the server"
    assert split_cpus({0, 2, 3}) is None, "0 and 2 are not a range VLLM_CPU_OMP_THREADS_BIND takes"

    def run(seed: int, rps: float, server_s: float | None = None) -> dict[str, Any]:
        got = {"seed": seed, "block": 0, "request_throughput": rps, "mean_ttft_ms": 100.0,
               "mean_tpot_ms": 10.0, "median_ttft_ms": 100.0, "duration": 4.0}  # fmt: skip
        return got if server_s is None else got | {"server_cpu_s": server_s}

    runs = {
        "alone.random": [run(1, 8.0), run(2, 9.0)],
        "alone2.random": [run(1, 12.0), run(2, 9.0)],
        "kv.random": [run(1, 9.5, 0.2), run(2, 8.55, 0.4)],
    }
    res = {"runs": runs, "load": {"start": [0.0, 0.0, 0.0]}}
    got = {r.name: r for r in records(SERVE, res, "0-0", 1)}
    rps = got["serving_cores.store_on_miss.request_throughput"]
    assert rps.ratio == pytest.approx(0.95), f"9.5/10 and 8.55/9 against both alone: {rps}"
    assert "CPUs 0-0, the kvstore-server on CPU 1" in rps.notes, rps.notes
    control = got["serving_cores.store_on_miss.control.request_throughput"]
    assert control.ratio == pytest.approx(1.25), f"alone2 / alone: 1.5 and 1.0: {control}"
    cpu = got["serving_cores.store_on_miss.server_cpu"]
    assert cpu.value == pytest.approx(7.5), f"0.2 and 0.4 s of its one CPU over 4 s runs: {cpu}"


def test_each_set_of_engines_starts_in_an_order_rotated_by_one_and_takes_its_own_seeds() -> None:
    """No kind of engine is always started first or in the middle, and every seed runs in
    exactly one set."""
    from benchmarks.serving import engine_sets

    seeds = list(range(180, 195))
    sets = list(engine_sets(3, seeds))
    assert [order for _, order, _ in sets] == [
        ["alone", "kv", "alone2"],
        ["kv", "alone2", "alone"],
        ["alone2", "alone", "kv"],
    ], "each set's start order is the last one's rotated by one"
    assert [b for b, _, _ in sets] == [0, 1, 2]
    mine = [s for _, _, part in sets for s in part]
    assert sorted(mine) == seeds and len(mine) == len(set(mine)), f"seeds split: {sets}"


def test_the_kvstore_engine_runs_again_with_kvstore_off_next_to_its_own_turn(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The no-reuse turns add ``kv.off``, the kvstore engine with every request turning
    kvstore off, next to ``kv`` (after it, before it when the turns reverse); only its
    runs carry the request parameter; the report pairs kv with kv.off on the same engine
    (kvstore's work) and kv.off with both engines alone (the connector doing nothing),
    and leaves both out for results without kv.off."""
    import benchmarks.serving as serving
    from benchmarks.serving import QUICK, take_turns, with_kv_off
    from benchmarks.serving_report import records, table

    class Engine:
        def processes(self) -> dict[str, int]:
            return {}

    engines = {"kv": Engine(), "alone2": Engine(), "alone": Engine()}
    turns = with_kv_off(engines)  # type: ignore[arg-type]
    assert list(turns) == ["kv", "kv.off", "alone2", "alone"], list(turns)
    assert turns["kv.off"] is engines["kv"], "kv.off is the same engine as kv"
    sent: list[tuple[str, list[str]]] = []

    def client(server: Any, model: Path, load: list[str], seed: int, log: Path) -> dict:
        name = next(n for n, e in engines.items() if e is server)
        sent.append((name, load))
        return {"request_throughput": 1.0}

    monkeypatch.setattr(serving, "client", client)
    monkeypatch.setattr(serving, "SETTLE_S", 0.0)
    got_runs: dict[str, list[dict[str, Any]]] = {}
    take_turns(turns, got_runs, tmp_path, ["--x"], [1, 2], tmp_path, ".random")  # type: ignore[arg-type]
    off = {"kv_transfer_params": {"kvstore": {"load": False, "save": False}}}
    with_off = [
        (name, json.loads(load[load.index("--extra-body") + 1]) if "--extra-body" in load else None)
        for name, load in sent
    ]
    assert with_off == [
        ("kv", None), ("kv", off), ("alone2", None), ("alone", None),
        ("alone", None), ("alone2", None), ("kv", off), ("kv", None),
    ], f"kv.off's runs, and only they, turn kvstore off, next to kv's: {with_off}"  # fmt: skip
    assert sorted(got_runs) == ["alone.random", "alone2.random", "kv.off.random", "kv.random"]

    def run(seed: int, rps: float) -> dict[str, Any]:
        return {"seed": seed, "block": 0, "request_throughput": rps, "mean_ttft_ms": 100.0,
                "mean_tpot_ms": 10.0, "median_ttft_ms": 100.0, "duration": 4.0}  # fmt: skip

    runs = {
        "alone": [run(1, 10.0)], "alone2": [run(1, 10.0)], "kv": [run(1, 10.0)],
        "kv2.restart": [run(1, 10.0)], "alone.nocache": [run(7, 5.0)],
        "kv.nocache": [run(7, 5.0)],
        "alone.random": [run(1, 8.0), run(2, 9.0)], "alone2.random": [run(1, 12.0), run(2, 9.0)],
        "kv.random": [run(1, 9.0), run(2, 9.0)], "kv.off.random": [run(1, 10.0), run(2, 9.0)],
    }  # fmt: skip
    got = {r.name: r for r in records(QUICK, {"runs": runs})}
    same = got["serving.store_on_miss.same_engine.request_throughput"]
    assert same.ratio == pytest.approx(0.95), f"9/10 and 9/9 on the same engine: {same}"
    assert "kvstore off: " in same.notes, same.notes
    idle = got["serving.store_on_miss.idle.request_throughput"]
    assert idle.ratio == pytest.approx(1.0), f"10/10 and 9/9 against both alone: {idle}"
    assert "kvstore, every request with it off" in table(QUICK, {"runs": runs})
    del runs["kv.off.random"]
    older = {r.name for r in records(QUICK, {"runs": runs})}
    assert not any(".same_engine." in n or ".idle." in n for n in older), sorted(older)
