"""Soak: the fault suite's 16-client mix for a long time, with a server crash and a Redis outage
every so often. Run by hand; its figures go into docs/reliability.md.

    python benchmarks/soak.py                       # 10 minutes (about 12 min with set-up)
    python benchmarks/soak.py --minutes 2 --kill-every 30 --redis-every 45
    python scripts/reliability_report.py            # puts the figures into the report

One kvstore-server (L1 256 MiB, L2 LMDB, L3 Redis with a short breaker cooldown)
serves 16 clients (8 over shared memory, 8 streaming over TCP) that put, get,
look up and delete for ``--minutes``, reading every chunk back byte for byte
(kvstore/testing/mix.py). Every ``--kill-every`` seconds the server is killed with
SIGKILL and restarted on the same data dir; then every acknowledged chunk that
had been written down must be found again (else *lost*) and every chunk found
must hold its bytes (else *wrong*); chunks acknowledged but only in memory at
the kill are counted as *volatile* (L1 is volatile by design). Every
``--redis-every`` seconds Redis is stopped for ``--redis-down`` seconds: the server
must keep answering, and use Redis again once it is back.

Writes ``benchmarks/results/soak.json`` (``--out``; ``./kvstore-bench/results/soak.json``
when run as an installed ``kvstore.benchmarks.soak``). Exit status 1 when anything
was lost or wrong, or a call failed outside a crash window.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import kvstore
from kvstore.errors import KVStoreError
from kvstore.testing.mix import Mix, MixConfig, reconcile, wait_for
from kvstore.testing.redis import RedisServer
from kvstore.testing.server import KVServer

if __package__:
    from .harness import output_dir
else:  # run by path (python benchmarks/soak.py): this folder is sys.path[0]
    from harness import output_dir

DEFAULT_OUT = output_dir() / "results" / "soak.json"  # benchmarks/results in the checkout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--kill-every", type=float, default=90.0, metavar="SECONDS")
    ap.add_argument("--redis-every", type=float, default=120.0, metavar="SECONDS")
    ap.add_argument("--redis-down", type=float, default=10.0, metavar="SECONDS")
    ap.add_argument("--prompts", type=int, default=40, help="prompts per client (working set)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return ap.parse_args(argv)


def _remote_healthy(c: kvstore.Client) -> bool:
    return next(t for t in c.stats().tiers if t.name == "remote").healthy


def soak(args: argparse.Namespace) -> dict[str, Any]:
    seconds = args.minutes * 60
    work = Path(tempfile.mkdtemp(prefix="kvstore-soak-"))
    redis = RedisServer("redis")
    config = work / "kvstore.toml"
    config.write_text(
        f'[remote]\nurl = "{redis.url}"\ntimeout_ms = 200\n'
        "connect_timeout_ms = 200\nfailure_threshold = 2\ncooldown_ms = 1000\n"
    )
    srv = KVServer(
        work,
        "soak",
        memory="256MiB",
        args=[
            "--config",
            str(config),
            "--chunk-tokens",
            "16",
            "--granularity",
            "4",
            "--log-level",
            "warning",
        ],
    ).start()
    mix = Mix(
        MixConfig(
            url=[srv.unix_url, srv.tcp_url],
            clients=args.clients,
            seconds=seconds,
            shm=lambda i: i % 2 == 0,
            tolerate_down=True,
            timeout=5.0,
            prompts=args.prompts,
            seed=42,
            tag="soak",
        )
    )
    events: list[dict[str, Any]] = []
    totals = {"lost": 0, "wrong": 0, "volatile": 0, "found": 0}
    kill_recovery: list[float] = []
    redis_recovery: list[float] = []
    crashing = threading.Event()
    probe_stop = threading.Event()
    log = print

    def prober() -> None:
        """Mark chunks the server reports on disk as durable (only a live server answers)."""
        with kvstore.Client(srv.unix_url, shm=False, timeout=3.0) as p:
            while not probe_stop.wait(0.5):
                if not crashing.is_set():
                    try:
                        mix.probe_durable(p)
                    except KVStoreError:
                        pass

    def crash() -> None:
        crashing.set()
        t0 = time.monotonic()
        srv.stop(signal.SIGKILL)
        if not mix.pause(60):
            raise RuntimeError("client threads did not park after the kill")
        t_restart = time.monotonic()  # recovery: restart to serving (LMDB reopened, indexed)
        srv.start()
        with kvstore.Client(srv.unix_url, shm=False) as c:
            wait_for(c.health, 60, "the restarted server")
            recovery = time.monotonic() - t_restart
            out = reconcile(mix.ledger, c)
        for k in totals:
            totals[k] += out[k]
        kill_recovery.append(recovery)
        events.append(
            {
                "t": round(t0 - start, 1),
                "fault": "kill -9",
                "recovery_s": round(recovery, 2),
                **{k: out[k] for k in ("checked", "found", "lost", "wrong", "volatile")},
            }
        )
        log(
            f"[{t0 - start:6.0f} s] kill -9: back in {recovery:.2f} s; {out['found']} found, "
            f"{out['volatile']} volatile, {out['lost']} lost, {out['wrong']} wrong"
        )
        crashing.clear()
        mix.resume()

    def redis_outage() -> None:
        t0 = time.monotonic()
        redis.stop()
        time.sleep(args.redis_down)
        redis.start()
        t_up = time.monotonic()
        with kvstore.Client(srv.unix_url, shm=False) as c:
            try:
                wait_for(lambda: _remote_healthy(c), 60, "Redis to be healthy again")
                recovery = time.monotonic() - t_up
            except AssertionError:
                recovery = float("nan")
        redis_recovery.append(recovery)
        events.append(
            {
                "t": round(t0 - start, 1),
                "fault": "redis stop/start",
                "down_s": args.redis_down,
                "recovery_s": round(recovery, 2),
            }
        )
        log(
            f"[{t0 - start:6.0f} s] Redis down {args.redis_down:.0f} s; healthy again "
            f"{recovery:.2f} s after it came back"
        )

    start = time.monotonic()
    mix.start()
    probe = threading.Thread(target=prober, daemon=True)
    probe.start()
    next_kill, next_redis = args.kill_every, args.redis_every
    try:
        while time.monotonic() - start < seconds - 5:
            now = time.monotonic() - start
            if now >= next_kill:
                crash()
                next_kill += args.kill_every
            elif now >= next_redis:
                redis_outage()
                next_redis += args.redis_every
            else:
                time.sleep(0.5)
    finally:
        mix.stop()
        tally = mix.join(120)
        probe_stop.set()
        probe.join(10)
    with kvstore.Client(srv.unix_url, shm=False) as c:  # the end: every live chunk verified
        final = reconcile(mix.ledger, c)
        stats = c.stats()
    rc = srv.stop()
    redis.close()
    elapsed = time.monotonic() - start
    kills = sum(e["fault"] == "kill -9" for e in events)
    outages = len(events) - kills
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "minutes": round(elapsed / 60, 1),
        "clients": args.clients,
        "kills": kills,
        "redis_outages": outages,
        "faults": len(events),
        "requests": tally.requests,
        "gets": tally.gets,
        "hits": tally.hits,
        "chunks_stored": tally.stored,
        "lookups": tally.lookups,
        "deletes": tally.deletes,
        "unavailable_calls": tally.unavailable,
        "errors": tally.errors,
        "lost": totals["lost"] + tally.lost + final["lost"],
        "wrong": totals["wrong"] + tally.wrong + final["wrong"],
        "volatile": totals["volatile"],
        "found_after_crash": totals["found"],
        "verified_at_end": final["found"],
        "kill_recovery_s": {
            "max": round(max(kill_recovery, default=0.0), 2),
            "mean": round(statistics.fmean(kill_recovery), 2) if kill_recovery else None,
        },
        "redis_recovery_s": {"max": round(max(redis_recovery, default=0.0), 2)},
        "slowest_call_s": round(tally.slowest, 2),
        "server_exit": rc,
        "chunks_at_end": stats.chunks,
        "details": (tally.details + final["details"])[:20],
        "events": events,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = soak(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("events", "details")}, indent=1))
    print(f"wrote {args.out}")
    bad = result["lost"] or result["wrong"] or result["errors"] or result["server_exit"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
