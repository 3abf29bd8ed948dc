"""A multi-round chat replayed through vLLM, without and with kvstore: hit rate and TTFT.

The workload: ``users`` users chat for ``rounds`` rounds; every conversation starts
with the same system prompt. Round r of user u sends

    system prompt + (turn 1 + reply 1 + ... + turn r-1 + reply r-1) + turn r

Turns and replies are synthetic token ids (random, fixed by the seed, lengths
varying by +-50%): a *replay* of a recorded chat, so both engines see exactly the
same prompts whatever they would have answered. Rounds are served in order, the
users of a round one after the other (as a chat service sees them arrive).

Two vLLM engines (``python -m benchmarks.replay --spec``), the same random Llama,
side by side, taking turns request by request in a shuffled order so noise on this
shared machine lands on both alike:

- ``without``: vLLM alone, prefix caching OFF: every prompt is computed in full.
- ``with``: the same plus KVStoreConnector (kv_both) against a kvstore-server this
  suite starts (Unix socket, shared memory, L1 only): a prompt loads what earlier
  prompts stored (the system prompt, the user's previous prompt) and computes the rest.

Prefix caching is off in *both* runs, so the comparison is exactly "load from
kvstore" against "recompute". The alternative, prefix caching on with a KV cache
small enough to evict, would make the result a function of the chosen cache size
(vLLM's CPU cache is sized in whole GiB, which holds this whole workload of a small
model, so it would never evict unless overridden); off gives the figure for the
case kvstore exists for: histories that are no longer in the engine (many users,
idle gaps between turns, a restarted or different engine).

TTFT is the wall time of one ``llm.generate([prompt], max_tokens=1)`` (scheduling,
the connector's lookup and load, the forward pass of what is not loaded, sampling).
Hit rate is the tokens the connector loaded (vLLM's ``num_cached_tokens``) over the
prompt tokens; its limit is the ideal: for each prompt, its longest common prefix
with any earlier prompt, in whole blocks of 128 tokens, excluding the last token
(vLLM always computes at least one). The replies are never prefilled (max_tokens=1),
so they are never stored: that is the part of each new prompt a chat must compute
in any case, along with the new turn.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .engines import (
    MARK_READY,
    MARK_TTFT,
    EngineProcess,
    emit,
    engine_env,
    kv_bytes_per_token,
    kvstore_connector,
    scratch,
)
from .harness import PACKAGE, Progress, Record, ServerProcess, module, percentile

BLOCK = 128  # vLLM's CPU block size: loads are whole blocks
DRIVER = module("replay")
BASE = "vLLM without kvstore (prefix caching off: recompute)"


@dataclass(frozen=True)
class Params:
    users: int
    rounds: int
    system_tokens: int
    turn_tokens: int  # mean; each turn is 0.5-1.5x this
    reply_tokens: int  # mean, likewise
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    dtype: str = "float32"
    vocab: int = 1024
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.layers, self.hidden, self.heads, self.kv_heads, self.dtype)

    def describe(self) -> str:
        return (
            f"{self.users} users x {self.rounds} rounds, system prompt {self.system_tokens} "
            f"tokens, turns ~{self.turn_tokens}, replies ~{self.reply_tokens}; random Llama "
            f"{self.layers} layers, hidden {self.hidden}, {self.kv_heads} KV heads, {self.dtype}"
        )


QUICK = Params(2, 2, 512, 128, 128, 2, 256, 4, 2)
# The connector suite's full model: a 1k-token prefill takes ~1-2 s here.
FULL = Params(4, 5, 1536, 256, 256, 8, 1024, 16, 4)


# -- workload ------------------------------------------------------------------------------
def conversation(p: Params) -> list[list[list[int]]]:
    """``prompts[round][user]``: token ids, deterministic for ``p``."""
    rng = random.Random(p.seed)

    def text(mean: int) -> list[int]:
        return [rng.randrange(10, p.vocab) for _ in range(rng.randint(mean // 2, mean * 3 // 2))]

    system = [rng.randrange(10, p.vocab) for _ in range(p.system_tokens)]
    history: list[list[int]] = [[] for _ in range(p.users)]
    prompts = []
    for _ in range(p.rounds):
        row = []
        for u in range(p.users):
            turn = text(p.turn_tokens)
            row.append(system + history[u] + turn)
            history[u] += turn + text(p.reply_tokens)
        prompts.append(row)
    return prompts


def ideal_hits(order: list[list[int]]) -> list[int]:
    """Per prompt (in serving order): tokens an ideal cache of earlier prompts could serve."""
    out = []
    for i, tokens in enumerate(order):
        best = 0
        for prev in order[:i]:
            n = min(len(prev), len(tokens))
            j = 0
            while j < n and prev[j] == tokens[j]:
                j += 1
            best = max(best, j)
        # whole stored blocks; a prompt served to its end still computes its last token
        out.append(min(best // BLOCK * BLOCK, len(tokens) - 1))
    return out


# -- the engine process --------------------------------------------------------------------
def driver(spec_path: str) -> int:
    """Build one engine from the spec; then time one prompt per stdin line."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_len = int(spec["max_model_len"])
    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
        max_model_len=max_len, max_num_batched_tokens=max_len, max_num_seqs=4,
        enforce_eager=True, seed=0, enable_prefix_caching=False,
    )  # fmt: skip
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    emit(MARK_READY, {})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        prompt = TokensPrompt(prompt_token_ids=cmd["tokens"])
        t0 = time.perf_counter()
        outs = llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        emit(MARK_TTFT, {"seconds": seconds, "token": int(outs[0].outputs[0].token_ids[0]),
                     "cached": int(outs[0].num_cached_tokens or 0)})  # fmt: skip
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return 0


# -- the replay ---------------------------------------------------------------------------------
def measure(p: Params, progress: Progress, work: Path) -> dict[str, list[dict[str, Any]]]:
    """Per engine, one result per request in serving order (round by round)."""
    from kvstore.testing.tinymodel import make_tiny_llama

    prompts = [tokens for row in conversation(p) for tokens in row]
    max_len = (max(len(t) for t in prompts) // BLOCK + 2) * BLOCK
    model = make_tiny_llama(work / "model", layers=p.layers, hidden=p.hidden, heads=p.heads,
                            kv_heads=p.kv_heads, vocab=p.vocab, max_position_embeddings=max_len,
                            dtype=p.dtype)  # fmt: skip
    total = sum(len(t) for t in prompts) + 4 * BLOCK
    server = ServerProcess(work, 2 * total * p.kv_bytes_per_token + (64 << 20)).start()
    url = server.url
    env = engine_env(2 * max_len * p.kv_bytes_per_token)
    base = {"model": str(model), "dtype": p.dtype, "max_model_len": max_len}
    connector = kvstore_connector(url)
    engines: dict[str, EngineProcess] = {}
    try:
        engines["without"] = EngineProcess("without", DRIVER, base, work, env)
        engines["with"] = EngineProcess(
            "with", DRIVER, {**base, "kv_transfer_config": connector}, work, env
        )
        for e in progress(list(engines.values()), desc="starting 2 vLLM engines"):
            e.wait_ready()
        rng = random.Random(p.seed + 1)  # not the workload's generator: its own prefix
        warm = [rng.randrange(10, p.vocab) for _ in range(2 * BLOCK + 5)]
        for e in engines.values():  # first forward passes; the data plane's first load
            for _ in range(2):
                e.request({"tokens": warm})
        time.sleep(1.0)  # the client's background prefault of the arena
        out: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        order = list(engines)
        for tokens in progress(prompts, desc="replaying requests"):
            rng.shuffle(order)
            for name in order:
                out[name].append(engines[name].request({"tokens": tokens}) | {"n": len(tokens)})
        return out
    finally:
        for e in engines.values():
            e.close()
        server.close()


def records(p: Params, got: dict[str, list[dict[str, Any]]]) -> list[Record]:
    prompts = [tokens for row in conversation(p) for tokens in row]
    ideal = ideal_hits(prompts)
    w, wo = got["with"], got["without"]
    loaded, tokens = sum(r["cached"] for r in w), sum(r["n"] for r in w)
    if sum(ideal) and not loaded:
        raise RuntimeError("the kvstore engine loaded nothing: the replay measured misses only")
    same = sum(a["token"] == b["token"] for a, b in zip(w, wo, strict=True))
    agree = f"first tokens agree in {same} of {len(w)} requests"
    desc = p.describe()
    out = [
        Record("replay.hit_rate.with_kvstore", loaded / tokens, "fraction", sum(ideal) / tokens,
               limit_name="ideal: every earlier prompt's common prefix, whole blocks",
               notes=f"tokens loaded / prompt tokens over {len(w)} requests; {desc}"),
        Record("replay.hit_rate.without_kvstore", sum(r["cached"] for r in wo) / tokens,
               "fraction", notes="prefix caching off: nothing is reused"),
    ]  # fmt: skip
    for stat in ("mean", "p90"):

        def f(rs: list[dict[str, Any]], stat: str = stat) -> float:
            xs = [r["seconds"] for r in rs]
            return statistics.fmean(xs) if stat == "mean" else percentile(xs, 90)

        out += [
            Record(f"replay.ttft.{stat}.without_kvstore", f(wo), "s",
                   notes=f"{BASE}; {len(wo)} requests"),
            Record(f"replay.ttft.{stat}.with_kvstore", f(w), "s", f(wo), limit_name=BASE,
                   target="ratio < 1" if stat == "mean" else "",
                   notes=f"KVStoreConnector, shared memory, L1 only; {agree}"),
        ]  # fmt: skip
    n = p.users
    for r in range(p.rounds):
        rw, rwo = w[r * n : (r + 1) * n], wo[r * n : (r + 1) * n]
        mean_w = statistics.fmean(x["seconds"] for x in rw)
        mean_wo = statistics.fmean(x["seconds"] for x in rwo)
        hit = sum(x["cached"] for x in rw) / sum(x["n"] for x in rw)
        lens = f"{min(x['n'] for x in rw)}-{max(x['n'] for x in rw)}"
        out.append(
            Record(
                f"replay.ttft.mean.round={r + 1}",
                mean_w,
                "s",
                mean_wo,
                limit_name=BASE,
                notes=f"round {r + 1}: prompts of {lens} tokens, hit rate {hit:.2f}",
            )
        )
    return out


def run(quick: bool, progress: Progress) -> list[Record]:
    p = QUICK if quick else FULL
    with scratch("replay") as work:
        got = measure(p, progress, work)
    print(f"[replay] {p.describe()}", file=sys.stderr)
    return records(p, got)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--spec":
        sys.exit(driver(sys.argv[2]))
    sys.exit(
        f"usage: python -m {DRIVER} --spec SPEC (run the suite with "
        f"python -m {PACKAGE} --only replay)"
    )
