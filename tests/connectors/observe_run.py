"""One vLLM engine for tests/connectors/test_vllm_observe.py: what vLLM itself publishes
of the connector (KV events, Prometheus counters) over a store, a load and resets.

    python tests/connectors/observe_run.py --spec spec.json --out out.json

spec.json: {"model": DIR, "prompt": [tok, ...], "kv_transfer_config": {...}, "events_port": N}
out.json:  {"phases": [result, ...], "events": [[{"type": ..., ...}, ...] per phase],
            "metrics": {name: value summed over labels}}

Phases, one engine, vLLM's own prefix cache on: 1 the prompt (stored); 2 after
``reset_prefix_cache()`` (vLLM's cache only: loaded from kvstore); 3 after
``reset_prefix_cache(reset_connector=True)`` (kvstore's too: computed, stored again);
4 after ``reset_prefix_cache()`` (loaded again). Events come from vLLM's ZMQ publisher,
read by a subscriber here (bound on loopback; the publisher connects to it); metrics
from the Prometheus registry vLLM's ``/metrics`` serves.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from tests.connectors.phases import _results


def _event(e: Any) -> dict[str, Any]:
    def h(x: Any) -> Any:
        return x.hex() if isinstance(x, bytes) else x

    out: dict[str, Any] = {"type": type(e).__name__}
    if hasattr(e, "block_hashes"):
        out["block_hashes"] = [h(x) for x in e.block_hashes]
        out["medium"] = e.medium
    if hasattr(e, "token_ids"):
        out.update(parent=h(e.parent_block_hash), tokens=len(e.token_ids), block_size=e.block_size)
    return out


class Subscriber:
    """vLLM's KV events as a router gets them: a ZMQ SUB socket on the publisher."""

    def __init__(self, port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        # vLLM's publisher binds wildcard endpoints and connects to the others: the
        # subscriber binds on loopback and the publisher dials it.
        self._sock: Any = zmq.Context.instance().socket(zmq.SUB)
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                _, _, payload = self._sock.recv_multipart()
                batch = self._decoder.decode(payload)
                with self._lock:
                    self.events.extend(_event(e) for e in batch.events)

    def take(self, settle_s: float = 1.0) -> list[dict[str, Any]]:
        time.sleep(settle_s)  # the publisher sends from its own thread
        with self._lock:
            out, self.events = self.events, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)


def _metrics() -> dict[str, float]:
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name.startswith(("vllm:kvstore_", "vllm:external_prefix_cache")):
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[family.name] = out.get(family.name, 0.0) + s.value
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sub = Subscriber(spec["events_port"])
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=True,
        disable_log_stats=False,
        kv_transfer_config=spec["kv_transfer_config"],
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{spec['events_port']}",
        },
    )
    time.sleep(1.0)  # ZMQ's slow joiner: subscribed before the first event is published
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    out: dict[str, Any] = {"phases": [], "events": []}
    resets: list[dict[str, bool] | None] = [None, {}, {"reset_connector": True}, {}]
    for reset in resets:
        if reset is not None:
            assert llm.reset_prefix_cache(**reset), f"reset_prefix_cache({reset}) failed"
        outs = llm.generate([TokensPrompt(prompt_token_ids=spec["prompt"])], params, use_tqdm=False)
        out["phases"].append(_results(outs)[0])
        out["events"].append(sub.take())
    llm.llm_engine.do_log_stats()
    out["metrics"] = _metrics()
    sub.close()
    Path(args.out).write_text(json.dumps(out))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
