"""The serving suite's report (``benchmarks.serving``): the records each paired
configuration gives, and the table its log prints. Runs are the result dicts of
``vllm bench serve`` plus what the suite measured around each (CPU time, seed, the set
of engines that ran it), keyed by engine name and workload tag."""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING, Any

from .harness import Record

if TYPE_CHECKING:
    from .serving import ServeParams

Runs = dict[str, list[dict[str, Any]]]


def _med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _spread(runs: list[dict[str, Any]], key: str, scale: float = 1.0, unit: str = "") -> str:
    vals = sorted(r[key] * scale for r in runs)
    return ", ".join(f"{_num(v)}{unit}" for v in vals)


def _range(runs: list[dict[str, Any]], key: str, unit: str = "") -> str:
    """Median (min-max): the spread of a configuration's runs on this noisy machine."""
    vals = [r[key] for r in runs]
    return f"{_num(statistics.median(vals))}{unit} ({_num(min(vals))}-{_num(max(vals))})"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _hits(runs: list[dict[str, Any]], p: ServeParams) -> str:
    """Prompt tokens served per run: by vLLM's own cache and by the connector."""
    own = statistics.median(r.get("prefix_cache_hits", 0) for r in runs)
    ext = statistics.median(r.get("external_prefix_cache_hits", 0) for r in runs)
    asked = statistics.median(r.get("total_input_tokens", 0) for r in runs)
    return (f"prompt tokens a run (median): {asked:.0f}, from vLLM's cache {own:.0f}, "
            f"from kvstore {ext:.0f}")  # fmt: skip


PAIRS = (
    # (record stem, case runs, limit runs, limit name, target)
    ("cache_on", "kv", "alone.on.both",
     "vLLM alone, prefix cache on, same workloads, turns alternating: the mean of the two "
     "engines alone (alone, alone2) in each turn",
     "throughput and TPOT within 5% (ratio 0.95-1.05)"),
    ("cache_off", "kv.nocache", "alone.nocache",
     "vLLM alone, prefix cache off, same workloads, turns alternating", "TTFT ratio < 1"),
    ("store_on_miss", "kv.random", "alone.both",
     "vLLM alone, prefix cache off, same no-reuse workloads, turns alternating: the mean of "
     "the two engines alone (alone, alone2) in each turn",
     "TTFT and throughput within 5%"),
)  # fmt: skip
# Pairs of runs recorded since session 15 (none in older results): the kvstore engine
# with every request turning kvstore off (kv_transfer_params), no lookups and no saves.
OFF_PAIRS = (
    ("store_on_miss.same_engine", "kv.random", "kv.off.random",
     "the same engine, every request with kvstore off (no lookup, no save), in the turn "
     "next to its own", "kvstore's work on a miss: within 5%",
     ("kvstore", "kvstore off")),
    ("store_on_miss.idle", "kv.off.random", "alone.both",
     "vLLM alone, the mean of the two engines alone (alone, alone2) in each turn",
     "what the connector costs doing nothing", ("kvstore off", "alone")),
)  # fmt: skip
METRICS = (("request_throughput", "req/s"), ("mean_ttft_ms", "ms"), ("mean_tpot_ms", "ms"),
           ("median_ttft_ms", "ms"))  # fmt: skip


COLD = (
    "vLLM alone, prefix cache on, the same workloads, each new to it (cold): the mean "
    "of the two engines alone"
)


def paired(case: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> list[float]:
    """case / base of the runs of each workload (seed): both ran it one after the other,
    so a change in what else this machine runs lands on both."""
    by_seed = {r["seed"]: r[key] for r in base}
    return [r[key] / by_seed[r["seed"]] for r in case if by_seed.get(r["seed"])]


def by_block(case: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> str:
    """The paired ratio's median within each set of engine instances, when there are
    several: how far one engine of each kind can be from another."""
    blocks = sorted({r.get("block", 0) for r in case})
    if len(blocks) < 2:
        return ""
    meds = [
        statistics.median(paired([r for r in case if r.get("block", 0) == b], base, key))
        for b in blocks
    ]
    return f"; by set of engines (each started anew): {', '.join(f'{m:.3f}' for m in meds)}"


def pooled(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per seed both ran, each number the mean of the two: the limit an engine
    with kvstore is paired with when two engines alone took the same turns. Engines alike
    differ by up to ~8% all their life (session 13): against one engine alone that
    engine's own speed is the whole limit, against two it is half of it."""
    by_seed = {r["seed"]: r for r in b}
    out = []
    for r in a:
        other = by_seed.get(r["seed"])
        if other is not None:
            out.append({k: (v + other[k]) / 2 if k in other and k not in ("seed", "block")
                        and isinstance(v, int | float) else v for k, v in r.items()})  # fmt: skip
    return out


# (the runs' tag, the pooled runs' name, the control record's stem): where two engines
# alone took turns with the one with kvstore
POOLS = (("", "alone.on.both", "cache_on"), (".random", "alone.both", "store_on_miss"))


def with_pooled(runs: Runs) -> Runs:
    """``runs`` plus ``alone.on.both`` (prefix cache on) and ``alone.both`` (no reuse): the
    runs of the two engines alone, pooled (just ``alone``'s where no second engine ran, as
    in results recorded before it)."""
    out = dict(runs)
    for tag, name, _ in POOLS:
        alone, control = runs.get("alone" + tag, []), runs.get("alone2" + tag, [])
        out[name] = pooled(alone, control) if control else alone
    return out


def pair_records(
    runs: Runs, p: ServeParams, stem: str, case: str, base: str, limit_name: str, target: str,
    names: tuple[str, str] = ("with kvstore", "alone"),
) -> list[Record]:  # fmt: skip
    """``stem``'s records (one per metric): the runs ``case`` paired with ``base`` by seed;
    ``names``: what the notes call each."""
    out = []
    for key, unit in METRICS:
        label = key.removesuffix("_ms")
        ratios = paired(runs[case], runs[base], key)
        out.append(Record(
            f"{stem}.{label}", _med(runs[case], key), unit, _med(runs[base], key),
            statistics.median(ratios), limit_name, target,
            f"ratio: the median of {len(ratios)} paired runs' ratios (same workload, back "
            f"to back): {', '.join(f'{r:.3f}' for r in sorted(ratios))}; {names[0]}: "
            f"{_spread(runs[case], key)}; {names[1]}: {_spread(runs[base], key)}; "
            f"{_hits(runs[case], p)}{by_block(runs[case], runs[base], key)}",
        ))  # fmt: skip
    return out


def control_records(runs: Runs, tag: str, stem: str) -> list[Record]:
    """The second engine alone against the first in the turns tagged ``tag`` (none when no
    second engine ran them): what the method reports where nothing differs."""
    control, alone = runs.get("alone2" + tag, []), runs.get("alone" + tag, [])
    out = []
    for key, unit in METRICS[:3] if control else ():
        ratios = paired(control, alone, key)
        out.append(Record(
            f"{stem}.control.{key.removesuffix('_ms')}",
            _med(control, key), unit, _med(alone, key),
            statistics.median(ratios), "vLLM alone, a second engine without kvstore",
            f"the method's own gap: {stem.rpartition('.')[2]} against it",
            f"two engines without kvstore, in the same turns as the one with kvstore "
            f"(alone, kvstore, alone2 in a rotated order; then reversed): what this method "
            f"reports where nothing differs. Ratios of {len(ratios)} pairs: "
            f"{', '.join(f'{r:.3f}' for r in sorted(ratios))}{by_block(control, alone, key)}",
        ))  # fmt: skip
    return out


def records(p: ServeParams, res: dict[str, Any]) -> list[Record]:
    runs: Runs = with_pooled(res["runs"])
    out: list[Record] = []
    for stem, case, base, limit_name, target in PAIRS:
        out += pair_records(runs, p, f"serving.{stem}", case, base, limit_name, target)
    for stem, case, base, limit_name, target, names in OFF_PAIRS:
        if runs.get(case) and runs.get(base):
            out += pair_records(runs, p, f"serving.{stem}", case, base, limit_name, target, names)
    for tag, _, stem in POOLS:
        out += control_records(runs, tag, f"serving.{stem}")
    miss = [r for r in runs["kv.random"] if "server_cpu_s" in r]
    alone = runs["alone.random"]
    if all("core_cpu_s" in r and "worker_cpu_s" in r for r in miss + alone) and miss:
        # Where the engine's own cycles went: vLLM's engine core (the scheduler, and its
        # reader spinning on sched_yield while the worker computes) and its worker.
        out.append(Record(
            "serving.store_on_miss.engine_core_cpu", _med(miss, "core_cpu_s"), "s",
            _med(alone, "core_cpu_s"),
            statistics.median(paired(miss, alone, "core_cpu_s")),
            "vLLM alone's engine core, same no-reuse runs", "",
            f"the CPU time of vLLM's engine-core process during each no-reuse run (its "
            f"scheduler, the connector's lookups, and its reader spinning on sched_yield "
            f"while the worker computes); with kvstore: {_spread(miss, 'core_cpu_s')} s; "
            f"alone: {_spread(alone, 'core_cpu_s')} s. The worker's, median: with kvstore "
            f"{_med(miss, 'worker_cpu_s'):.2f} s, alone {_med(alone, 'worker_cpu_s'):.2f} s a run",
        ))  # fmt: skip
    if miss:
        cores = os.cpu_count() or 1
        shares = [r["server_cpu_s"] / (r["duration"] * cores) for r in miss]
        out.append(Record(
            "serving.store_on_miss.server_cpu", 100 * statistics.median(shares), "%",
            notes=f"the kvstore-server's CPU time during each no-reuse run with kvstore, as a "
            f"share of the host's {cores} cores over the run (median of "
            f"{len(miss)}: {', '.join(f'{100 * x:.1f}' for x in sorted(shares))} %); "
            f"{statistics.median(r['server_cpu_s'] for r in miss):.3f} s a run "
            f"({p.prompts} prompts of {p.random_len} tokens stored, "
            f"{p.prompts * p.random_len * p.kv_bytes_per_token >> 20} MiB)",
        ))  # fmt: skip
        # What kvstore is seen to take from a run it could not help, without the host's
        # noise: the time the engine waited for it, its worker's thread in the step's saves
        # and its scheduling loop for each new request's lookup. The server's CPU is not
        # counted: a process burning as much beside vLLM cost it nothing measurable
        # (docs/performance.md, session 9).
        saving = [r.get("kvstore_save_seconds", 0.0) / r["duration"] for r in miss]
        asking = [r.get("kvstore_lookup_seconds", 0.0) / r["duration"] for r in miss]
        wait = [a + b for a, b in zip(saving, asking, strict=True)]
        out.append(Record(
            "serving.store_on_miss.engine_wait", 100 * statistics.median(wait), "%",
            notes=f"the share of each no-reuse run the engine waited for kvstore: the worker's "
            f"thread in the step's saves (vllm:kvstore_save_seconds) and the scheduler's loop "
            f"for the lookups (vllm:kvstore_lookup_seconds), over the run's duration (median "
            f"of {len(wait)}: {', '.join(f'{100 * x:.1f}' for x in sorted(wait))} %; saves "
            f"{100 * statistics.median(saving):.1f} %, "
            f"{statistics.median(r.get('kvstore_save_seconds', 0.0) for r in miss):.3f} s a "
            f"run; lookups {100 * statistics.median(asking):.1f} %, "
            f"{statistics.median(r.get('kvstore_lookup_seconds', 0.0) for r in miss):.3f} s "
            f"a run). What kvstore is seen to take, not the host's noise; the connector's "
            f"other hooks in the step (binding its metadata, the per-layer calls) are left out",
        ))  # fmt: skip
    restart, cold = runs["kv2.restart"], runs["alone.on.both"]
    out.append(Record(
        "serving.restart.mean_ttft", _med(restart, "mean_ttft_ms"), "ms",
        _med(cold, "mean_ttft_ms"),
        statistics.median(paired(restart, cold, "mean_ttft_ms")), COLD, "ratio < 1",
        f"medians of {len(restart)} runs: a new engine (the last set's kvstore engine "
        f"stopped) against the kvstore-server the kvstore engines filled, running their "
        f"workloads again: {_spread(restart, 'mean_ttft_ms')} ms; both engines alone (mean): "
        f"{_spread(cold, 'mean_ttft_ms')} ms; {_hits(restart, p)}",
    ))  # fmt: skip
    out.append(Record(
        "serving.restart.request_throughput", _med(restart, "request_throughput"), "req/s",
        _med(cold, "request_throughput"), None, COLD, "",
        "the restarted engine's request throughput",
    ))  # fmt: skip
    return out


def table(p: ServeParams, res: dict[str, Any]) -> str:
    runs: Runs = with_pooled(res["runs"])
    short = {"alone": "a", "alone.on.both": "a, both engines alone", "alone.nocache": "c",
             "alone.random": "alone, no reuse",
             "alone.both": "both engines alone, no reuse"}  # fmt: skip
    names = {"alone": "(a) alone, cache on", "alone2": "a second engine alone, cache on (control)",
             "kv": "(b) + kvstore, cache on",
             "kv2.restart": "(e) + kvstore, new engine", "alone.nocache": "(c) alone, cache off",
             "kv.nocache": "(d) + kvstore, cache off", "alone.random": "alone, no reuse",
             "kv.random": "+ kvstore, no reuse",
             "kv.off.random": "+ kvstore, every request with it off, no reuse",
             "alone2.random": "a second engine alone, no reuse (control)"}  # fmt: skip
    limits = {"alone2": "alone", "kv": "alone.on.both", "kv2.restart": "alone.on.both",
              "kv.nocache": "alone.nocache",
              "kv.random": "alone.both", "kv.off.random": "alone.both",
              "alone2.random": "alone.random"}  # fmt: skip
    rows = ["| configuration | runs | req/s | mean TTFT | mean TPOT | vs | req/s ratio | "
            "TTFT ratio | TPOT ratio | prompt tokens from vLLM's cache / kvstore |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, label in names.items():
        rs = runs.get(name)
        if not rs:
            continue
        base = limits.get(name)
        cells = ["", "", "", ""]
        if base:
            b = runs[base]
            cells = [f"({short[base]})"]
            for key in ("request_throughput", "mean_ttft_ms", "mean_tpot_ms"):
                rat = paired(rs, b, key)
                cells.append(f"{statistics.median(rat):.3f} ({min(rat):.2f}-{max(rat):.2f})")
        own = statistics.median(r.get("prefix_cache_hits", 0) for r in rs)
        ext = statistics.median(r.get("external_prefix_cache_hits", 0) for r in rs)
        rows.append(
            f"| {label} | {len(rs)} | {_range(rs, 'request_throughput')} | "
            f"{_range(rs, 'mean_ttft_ms', ' ms')} | {_range(rs, 'mean_tpot_ms', ' ms')}"
            f" | {' | '.join(cells)} | {own:.0f} / {ext:.0f} |"
        )
    return "\n".join(rows) + "\n"


def fmt_loads(loads: dict[str, list[float]]) -> str:
    """The 1/5/15-minute load averages at the start of each phase and at the end."""
    return "; ".join(f"{k}: {' / '.join(f'{x:.1f}' for x in v)}" for k, v in loads.items())
