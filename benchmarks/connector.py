"""vLLM connector end to end: time to first token, cold and warm, kvstore vs ExampleConnector.

Two engines run side by side, each in its own process (``benchmarks/ttft_driver.py``),
on the same random Llama, with prefix caching off (a warm prompt can only hit through
the connector) and the whole prompt prefilled in one step (max_num_batched_tokens =
max_model_len: vLLM's ExampleConnector saves only the first chunk under chunked
prefill and then crashes the engine on load, and it also crashes on batched partial
hits, a known vLLM issue; one request at a time, unchunked, is where it runs):

- kvstore: KVStoreConnector (kv_both) against a kvstore-server this suite starts on
  a Unix socket, shared-memory data plane on, L1 only (no LMDB write-through
  competing for the two cores with what is measured).
- example: vLLM's ExampleConnector (kv_both), safetensors files per layer in a
  local directory (page cache warm: the files were just written).

For each prompt length (a fresh random prompt each), every engine runs the prompt
once cold (nothing stored: it computes, and saves) and then ``warm_reps`` times warm
(loads the stored KV, computes the last block); the two engines take turns prompt by
prompt, in shuffled order, so noise on this shared machine lands on both alike.
TTFT is the wall time of one ``llm.generate([prompt], max_tokens=1)``. A warm run
must return the cold run's first token and report cached tokens, or the suite
raises: a benchmark that silently measures a miss measures nothing.

The cold figure is the kvstore engine's (it includes the lookup miss and the save);
the ExampleConnector engine's cold is reported beside it. With matplotlib installed,
a full run plots the figures into ``benchmarks/plots/connector_ttft.png``.
"""

from __future__ import annotations

import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engines import (
    EngineProcess,
    engine_env,
    kv_bytes_per_token,
    kvstore_connector,
    scratch,
)
from .harness import Progress, Record, ServerProcess, module, output_dir

PLOT = output_dir() / "plots" / "connector_ttft.png"
BLOCK = 128  # vLLM's CPU block size; a warm prompt of n = k * 128 tokens loads n - 1
DRIVER = module("ttft_driver")
WARMUP_SEED = 999
SETTLE_S = 1.5  # > vLLM's busy_loop_s (1 s) of its shared-memory message queues
INJECT_LINE = "Inject KV cache of"  # ExampleConnector's load
LOAD_LINE = re.compile(r"kvstore: loaded (\d+) of (\d+) tokens for \d+ request\(s\) in ([\d.]+) ms")


@dataclass(frozen=True)
class Params:
    lengths: tuple[int, ...]
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    warm_reps: int
    cold_reps: int  # fresh prompts per length, for prompts up to ``cold_reps_upto`` tokens
    cold_reps_upto: int
    dtype: str = "float32"
    vocab: int = 1024

    @property
    def max_model_len(self) -> int:
        return max(self.lengths) + 2 * BLOCK

    def colds(self, n: int) -> int:
        return self.cold_reps if n <= self.cold_reps_upto else 1

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.layers, self.hidden, self.heads, self.kv_heads, self.dtype)

    def describe(self) -> str:
        return (
            f"random Llama, {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
            f"{self.kv_heads} KV heads, {self.dtype}"
        )


# A cold run of 8k tokens takes 20-200 s here (2 shared cores), 16k minutes: run once.
FULL = Params((1024, 2048, 4096, 8192, 16384), 8, 1024, 16, 4, 5, 3, 2048)
QUICK = Params((1024, 2048), 2, 256, 4, 2, 3, 3, 2048)


# -- measurement -------------------------------------------------------------------------
@dataclass
class Side:
    """What one engine measured on one prompt length."""

    colds: list[dict[str, Any]] = field(default_factory=list)  # one per fresh prompt
    warm: list[dict[str, Any]] = field(default_factory=list)  # repeats of colds[0]'s prompt

    @property
    def cold(self) -> dict[str, Any]:
        return self.colds[0]

    @property
    def cold_s(self) -> float:
        return statistics.median(c["seconds"] for c in self.colds)

    @property
    def warm_s(self) -> float:
        return statistics.median(w["seconds"] for w in self.warm)

    def check(self, engine: str, n: int) -> None:
        for w in self.warm:
            if w["num_cached_tokens"] <= 0:
                raise AssertionError(
                    f"{engine}, {n} tokens: the warm run loaded nothing (a miss was measured)"
                )
            if w["token"] != self.cold["token"]:
                raise AssertionError(
                    f"{engine}, {n} tokens: warm first token {w['token']} != cold "
                    f"{self.cold['token']}: the loaded KV is not the computed KV"
                )
            # vLLM reports the promised tokens as cached even when the load failed and it
            # recomputed them: only the connectors' own log lines say what was loaded.
            if engine == "kvstore":
                loads = [m for m in map(LOAD_LINE.search, w["log"]) if m]
                if not loads or any(m.group(1) != m.group(2) for m in loads):
                    said = "; ".join(m.group(0) for m in loads) or "no load logged"
                    raise AssertionError(
                        f"kvstore, {n} tokens: the connector did not load what it promised "
                        f"({said}): vLLM recomputed, so this warm TTFT measures a miss"
                    )
            elif not any(INJECT_LINE in line for line in w["log"]):
                raise AssertionError(f"{engine}, {n} tokens: ExampleConnector logged no load")

    def logprob_gap(self) -> float:
        return max(abs(w["logprob"] - self.cold["logprob"]) for w in self.warm)


def example_config(path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def connector_env(p: Params) -> dict[str, str]:
    # Room for two prompts of the longest length (vLLM wants at least one).
    env = engine_env(2 * p.max_model_len * p.kv_bytes_per_token)
    # With a connector vLLM reserves two cores (scheduler, connector) for itself; finding
    # only two it falls back to two OpenMP threads on the cores the scheduler, the server
    # and other tenants use, and forward passes turn slow and erratic. One compute thread
    # on core 0, the rest on core 1: vLLM's own layout for an engine without a connector.
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    # A 16k-token prefill can outlast vLLM's 300 s step timeout on this shared machine.
    env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "7200"
    return env


def measure(p: Params, progress: Progress, work: Path) -> dict[int, dict[str, Side]]:
    from kvstore.testing.tinymodel import make_tiny_llama

    model = make_tiny_llama(
        work / "model",
        layers=p.layers,
        hidden=p.hidden,
        heads=p.heads,
        kv_heads=p.kv_heads,
        vocab=p.vocab,
        max_position_embeddings=p.max_model_len,
        dtype=p.dtype,
    )
    stored_tokens = sum(n * p.colds(n) for n in p.lengths) + 2 * BLOCK
    server = ServerProcess(work, 2 * stored_tokens * p.kv_bytes_per_token + (64 << 20))
    engines: dict[str, EngineProcess] = {}
    try:
        server.start()
        base = {"model": str(model), "dtype": p.dtype, "max_model_len": p.max_model_len,
                "vocab": p.vocab}  # fmt: skip
        env = connector_env(p)
        (work / "example").mkdir()
        # Built side by side: startup is not measured, and it halves the wait.
        configs = {
            "kvstore": kvstore_connector(server.url),
            "example": example_config(work / "example"),
        }
        for name, kv in configs.items():
            engines[name] = EngineProcess(
                name, DRIVER, {**base, "kv_transfer_config": kv}, work, env
            )
        for e in progress(list(engines.values()), desc="starting 2 vLLM engines"):
            e.wait_ready()
        # Warm-up: first forward passes, the shared-memory mapping, the data plane.
        for e in engines.values():
            for _ in range(2):
                e.request({"n": 2 * BLOCK, "seed": WARMUP_SEED})
        time.sleep(1.0)  # the client's background prefault of the arena
        last = ""

        def turn(name: str, n: int, seed: int) -> dict[str, Any]:
            nonlocal last
            if last and last != name:
                # vLLM's engine core and worker spin (sched_yield) for 1 s after each step,
                # the worker on the core both engines compute on: let them go idle first.
                time.sleep(SETTLE_S)
            last = name
            return engines[name].request({"n": n, "seed": seed})

        rng = random.Random(0)
        out: dict[int, dict[str, Side]] = {}
        for i, n in enumerate(progress(list(p.lengths), desc="prompt lengths")):
            sides = {name: Side() for name in engines}
            order = list(engines)
            rng.shuffle(order)
            for r in range(p.colds(n)):  # fresh prompts; the first one is reused warm
                rng.shuffle(order)
                for name in order:
                    sides[name].colds.append(turn(name, n, 100 * i + r))
            for _ in range(p.warm_reps):
                rng.shuffle(order)
                for name in order:
                    sides[name].warm.append(turn(name, n, 100 * i))
            for name, side in sides.items():
                side.check(name, n)
            out[n] = sides
        return out
    finally:
        for e in engines.values():
            e.close()
        server.close()


# -- records -----------------------------------------------------------------------------
def load_ms(side: Side) -> float | None:
    """Median over the warm runs of the connector's own load time (its log line)."""
    got = []
    for w in side.warm:
        for line in w["log"]:
            m = LOAD_LINE.search(line)
            if m:
                got.append(float(m.group(3)))
    return statistics.median(got) if got else None


def records(p: Params, results: dict[int, dict[str, Side]]) -> list[Record]:
    out: list[Record] = []
    for n, sides in results.items():
        kv, ex = sides["kvstore"], sides["example"]
        label = f"{n // 1024}k"
        cold, cold_ex = kv.cold_s, ex.cold_s
        same = "same" if kv.cold["token"] == ex.cold["token"] else "DIFFERENT"
        ms = load_ms(kv)
        load = f"; connector load {ms:.1f} ms (median)" if ms is not None else ""
        reps = f"median of {p.warm_reps}"
        out += [
            Record(f"connector.ttft.cold.{label}", cold, "s",
                   notes=f"{n} tokens, median of {len(kv.colds)} fresh prompt(s), nothing stored: "
                   "prefill + kvstore lookup miss + save; "
                   f"{same} first token as the ExampleConnector engine"),
            Record(f"connector.ttft.cold_example.{label}", cold_ex, "s",
                   notes=f"median of {len(ex.colds)}: the ExampleConnector engine's cold runs "
                   "(prefill + safetensors save)"),
            Record(f"connector.ttft.warm.{label}", kv.warm_s, "s", cold, None,
                   "cold TTFT (kvstore engine)", "ratio <= 0.05 (>= 20x)",
                   f"{reps}; {kv.warm[0]['num_cached_tokens']} tokens loaded over shared "
                   f"memory{load}; max |logprob warm - cold| {kv.logprob_gap():.1e}"),
            Record(f"connector.ttft.example.{label}", ex.warm_s, "s", cold_ex, None,
                   "cold TTFT (ExampleConnector engine)", "",
                   f"{reps}; ExampleConnector warm, {ex.warm[0]['num_cached_tokens']} tokens "
                   f"loaded from local safetensors files"),
            Record(f"connector.ttft.warm_vs_example.{label}", kv.warm_s, "s", ex.warm_s, None,
                   "ExampleConnector warm TTFT", "ratio <= 1.0 (aim 0.67)",
                   "kvstore warm / ExampleConnector warm, same prompt, turns interleaved"),
        ]  # fmt: skip
    return out


def table(results: dict[int, dict[str, Side]]) -> str:
    """The figures as a Markdown table (for docs/performance.md)."""
    rows = [
        "| prompt | cold (kvstore engine) | cold (Example engine) | kvstore warm | "
        "Example warm | cold / kvstore warm | kvstore / Example warm | kvstore load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, sides in results.items():
        kv, ex = sides["kvstore"], sides["example"]
        ms = load_ms(kv)
        rows.append(
            f"| {n:,} | {kv.cold_s:.2f} s | {ex.cold_s:.2f} s | "
            f"{kv.warm_s * 1e3:.0f} ms | {ex.warm_s * 1e3:.0f} ms | "
            f"{kv.cold_s / kv.warm_s:.0f}x | {kv.warm_s / ex.warm_s:.2f} | "
            f"{'' if ms is None else f'{ms:.1f} ms'} |"
        )
    return "\n".join(rows) + "\n"


def plot(records: Sequence[Record | dict[str, Any]], path: Path, model: str = "") -> bool:
    """Draw the TTFT figure from this suite's records (a run's, or from a results JSON)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by = {d["name"]: float(d["value"]) for d in (
        r.to_json() if isinstance(r, Record) else r for r in records)}  # fmt: skip
    labels = [m.group(1) for m in map(re.compile(r"connector\.ttft\.cold\.(\d+k)").fullmatch, by)
              if m]  # fmt: skip
    labels.sort(key=lambda k: int(k[:-1]))
    if not labels:
        return False
    ns = [int(k[:-1]) * 1024 for k in labels]

    def ys(kind: str) -> list[float]:
        return [by[f"connector.ttft.{kind}.{k}"] for k in labels]

    series = [
        ("cold (kvstore engine: prefill + save)", ys("cold"), "o-", "tab:red"),
        ("cold (ExampleConnector engine)", ys("cold_example"), "x--", "tab:orange"),
        ("warm, ExampleConnector (local files)", ys("example"), "s-", "tab:gray"),
        ("warm, kvstore (shared memory)", ys("warm"), "D-", "tab:blue"),
    ]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for label, y, style, color in series:
        ax.plot(ns, y, style, label=label, color=color, linewidth=1.8, markersize=6)
    for n, cold, warm in zip(ns, ys("cold"), ys("warm"), strict=True):
        ax.annotate(f"{cold / warm:.0f}x", (n, warm), textcoords="offset points",
                    xytext=(0, -16), ha="center", fontsize=9, color="tab:blue")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lowest = min(min(y) for _, y, _, _ in series)
    ax.set_ylim(bottom=lowest / 2.5)  # room for the labels under the lowest line
    ax.set_xticks(ns, labels)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("time to first token (s, log scale)")
    title = "vLLM (CPU) time to first token" + (f", {model}" if model else "")
    ax.set_title(f"{title}\nlabels: cold / kvstore warm", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def run(quick: bool, progress: Progress, parts: str = "ttft,loads") -> list[Record]:
    """The suite: TTFT against ExampleConnector (``ttft``), and the load path's bandwidth
    and warm TTFT against the compute floor (``loads``, ``benchmarks/connector_loads.py``).
    ``KVSTORE_BENCH_CONNECTOR=loads`` (or ``ttft``) runs one part only."""
    import os

    from . import connector_loads

    p = QUICK if quick else FULL
    todo = set(os.environ.get("KVSTORE_BENCH_CONNECTOR", parts).split(","))
    out: list[Record] = []
    with scratch("connector") as work:
        if "ttft" in todo:
            results = measure(p, progress, work)
            print(f"[connector] {p.describe()}\n" + table(results), file=sys.stderr)
            out += records(p, results)
            if not quick and plot(out, PLOT, p.describe()):
                print(f"[connector] plot: {PLOT}", file=sys.stderr)
        if "loads" in todo:
            out += connector_loads.run(quick, progress, work)
    return out
