"""Serving with kvstore on a core of its own (``--only serving_cores``): the serving
suite's no-reuse runs, the engines computing on every CPU but the last and the
kvstore-server bound to that one (``--cpus``), as an operator gives a cache server
cores the engine does not compute on.

The ``serving`` suite measures what a miss costs with the server on the cores vLLM
computes on: that is part of what kvstore costs on a host as small as this one, and it
stays the figure for issue 12's target. This suite says how much of that is the cores
it shares. Every engine here, with kvstore or without, has the same compute CPUs (one
fewer than in ``serving``): the connector's own threads go to the CPUs vLLM leaves
free (``connectors.vllm_cpus``), beside the server and the engines' other processes.
The method is ``serving``'s: ``random_blocks`` sets of new engines (alone, with
kvstore, a second alone), started in an order rotated by one, the kvstore engine paired
by seed with the mean of the two engines alone.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .engines import scratch
from .harness import Progress, Record
from .serving import (
    FULL,
    QUICK,
    ServeParams,
    engine_sets,
    engines,
    take_turns,
    tiny_model,
    workloads,
)
from .serving_report import Runs, control_records, fmt_loads, pair_records, table, with_pooled

LIMIT = (
    "vLLM alone, prefix cache off, same no-reuse workloads, the same compute CPUs, turns "
    "alternating: the mean of the two engines alone (alone, alone2) in each turn"
)


def split_cpus(allowed: set[int]) -> tuple[str, int] | None:
    """(the engines' compute CPUs as VLLM_CPU_OMP_THREADS_BIND takes them, the server's
    CPU): all but the highest, and the highest; None with fewer than two, or where those
    left to compute on are not one range (the bind takes ranges)."""
    cpus = sorted(allowed)
    if len(cpus) < 2 or cpus[-2] - cpus[0] != len(cpus) - 2:
        return None
    return f"{cpus[0]}-{cpus[-2]}", cpus[-1]


def measure(p: ServeParams, progress: Progress, work: Path, omp: str, own: int) -> dict[str, Any]:
    from kvstore.testing.server import KVServer

    model = tiny_model(p, work)
    stored = p.reps_random * p.prompts * p.random_len * 3 // 2  # and the warm-ups: no eviction
    server = KVServer(
        work / "srv", memory=str(stored * p.kv_bytes_per_token + (256 << 20)),
        args=["--log-level", "warning", "--cpus", str(own)],
    )  # fmt: skip
    load = workloads(p)["random"]
    runs: Runs = {}
    loads = {"start": list(os.getloadavg())}
    t0 = time.monotonic()
    seeds = [380 + r for r in range(p.reps_random)]
    try:
        server.start()
        pid = server.proc.pid if server.proc else None
        sets = list(engine_sets(p.random_blocks, seeds))
        for b, order, mine in progress(sets, desc="sets of engines"):
            with engines(p, model, work, server.unix_url, False, order, omp_bind=omp) as s:
                take_turns(s, runs, model, load, mine, work, ".random", pid, b)
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()
    loads["end"] = list(os.getloadavg())
    return {"runs": runs, "seconds": time.monotonic() - t0, "load": loads}


def records(p: ServeParams, res: dict[str, Any], omp: str, own: int) -> list[Record]:
    runs = with_pooled(res["runs"])
    target = "TTFT and throughput within 5% (issue 12's is read from the serving suite)"
    out = pair_records(
        runs, p, "serving_cores.store_on_miss", "kv.random", "alone.both", LIMIT, target
    )
    out += control_records(runs, ".random", "serving_cores.store_on_miss")
    miss = [r for r in runs["kv.random"] if "server_cpu_s" in r]
    if miss:
        shares = [r["server_cpu_s"] / r["duration"] for r in miss]
        out.append(Record(
            "serving_cores.store_on_miss.server_cpu", 100 * statistics.median(shares), "%",
            notes=f"the kvstore-server's CPU time during each run with kvstore, as a share of "
            f"its own CPU ({own}) over the run (median of {len(miss)}: "
            f"{', '.join(f'{100 * x:.1f}' for x in sorted(shares))} %)",
        ))  # fmt: skip
    for r in out:
        r.notes += (f"; engines computing on CPUs {omp}, the kvstore-server on CPU {own}; "
                    f"load averages (1/5/15 min) at {fmt_loads(res['load'])}")  # fmt: skip
    return out


def run(quick: bool, progress: Progress) -> list[Record]:
    split = split_cpus(os.sched_getaffinity(0))
    if split is None:
        print("[serving_cores] needs two CPUs or more in one range: nothing run", file=sys.stderr)
        return []
    omp, own = split
    p = QUICK if quick else FULL
    with scratch("serving_cores") as work:
        res = measure(p, progress, work, omp, own)
        print(f"[serving_cores] {p.describe()}; engines on CPUs {omp}, the kvstore-server on "
              f"CPU {own}; {res['seconds']:.0f} s; load averages at {fmt_loads(res['load'])}\n"
              f"{table(p, res)}", file=sys.stderr)  # fmt: skip
        return records(p, res, omp, own)
