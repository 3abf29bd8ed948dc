"""The connector's two halves driven the way vLLM's scheduler and model runner drive them,
without an engine: for tests of loads and saves against a real kvstore-server.

``Engine`` builds ``KVStoreScheduler`` and ``KVStoreWorker`` as ``KVStoreConnector`` does
(each with its own ``BreakerClient``, as in vLLM's two processes) over a paged CPU cache
shaped like vLLM's. ``Engine.step`` admits a batch of new requests in one scheduler
step, as vLLM's scheduler would: a synchronous hit is loaded in that step, an
asynchronous one waits (WAITING_FOR_REMOTE_KVS) while empty steps run until a worker
reports it in ``get_finished``, then it is scheduled with what loaded (vLLM truncates
its computed tokens at the first failed block) and computes the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from kvstore.connectors.vllm_client import BreakerClient
from kvstore.connectors.vllm_config import ConnectorConfig
from kvstore.connectors.vllm_meta import KVStoreMeta, KVStoreStats, Setup
from kvstore.connectors.vllm_namespace import EngineNamespace
from kvstore.connectors.vllm_scheduler import KVStoreScheduler
from kvstore.connectors.vllm_worker import KVStoreWorker

from kvstore.clock import Clock, monotonic
from kvstore.keys import Namespace
from kvstore.retry import BreakerState
from tests.connectors.test_blocks import make_cache

BS = 16  # tokens per block
NS = EngineNamespace(Namespace(model="test/halves", dtype="bfloat16", layout="test"))


@dataclass
class Admitted:
    """What happened to one request of ``Engine.step``."""

    rid: str
    told: int  # tokens vLLM was told to load
    background: bool  # load_async
    failed: set[int] = field(default_factory=set)  # blocks reported as load errors
    waited_s: float = 0.0  # how long it waited for its background load
    steps: int = 0  # empty steps it waited


class Blocks:
    """vLLM's KVCacheBlocks, as update_state_after_alloc sees them (one group)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


def step_output(
    new: list[tuple[str, list[int], int, int]], preempted: set[str] | None = None
) -> Any:
    """vLLM's SchedulerOutput: new requests as (rid, block ids, computed, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=rid, block_ids=(ids,), num_computed_tokens=computed)
            for rid, ids, computed, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={rid: n for rid, _, _, n in new},
        preempted_req_ids=preempted or set(),
        finished_req_ids=set(),
    )


class Engine:
    """One scheduler half and one worker half over one paged cache, as one engine."""

    def __init__(
        self,
        url: str,
        clock: Clock = monotonic,
        *,
        blocks: int = 96,
        fill: str = "random",
        **cfg: Any,
    ) -> None:
        settings: dict[str, Any] = dict(
            url=url,
            retry_after_ms=5000,
            # Long enough for a loaded machine: a spurious deadline would open a breaker.
            timeout_ms=3000,
            lookup_timeout_ms=2000,
            save_mode="sync",
            # These tests' loads are small: copied layer by layer all the same, unless a
            # test says otherwise.
            load_by_layer_bytes="0",
        )
        settings.update(cfg)
        config = ConnectorConfig(**settings)
        sched = BreakerClient(config, url, role="scheduler", clock=clock)
        work = BreakerClient(config, url, role="worker", clock=clock)
        # save=False / load=False: a kv_consumer / kv_producer, as the facade derives it
        setup = Setup(
            config, NS, BS, sched.chunk_tokens(BS), producer=config.save, consumer=config.load
        )
        self.scheduler = KVStoreScheduler(setup, sched, clock=clock)
        self.worker = KVStoreWorker(setup, work, clock=clock)
        self.cache = make_cache("cpu", "LBHNC", blocks=blocks, block_size=BS, fill=fill)
        self.worker.register_kv_caches(self.cache)
        self._n = 0
        self.decoding = 0  # requests decoding beside every step's own (a token each)
        # A step with tokens runs a forward pass whose attention layers each call
        # wait_for_layer_load (False: a model whose attention does not)
        self.forward_waits = True
        self.forward_layers: list[str] = []  # the layers forward passes waited for

    def step(
        self,
        prompts: list[tuple[list[int], list[int]]],
        *,
        wait_s: float = 30.0,
        between: Any = None,
        computed: list[int] | None = None,
        params: list[dict[str, Any] | None] | None = None,
    ) -> list[Admitted]:
        """Admit (prompt, block ids) requests in one step, run them to the end of their
        prefill (loads, saves) and finish them. ``computed``: tokens each already has in
        vLLM's own prefix cache (block aligned). ``between(engine, admitted)`` runs after
        the first step, while background loads may be in flight. ``params``: each
        request's ``kv_transfer_params``."""
        local = computed or [0] * len(prompts)
        reqs, out = [], []
        for (tokens, _), kv_params in zip(prompts, params or [None] * len(prompts), strict=True):
            self._n += 1
            rid = f"req-{self._n}"
            reqs.append(
                SimpleNamespace(
                    request_id=rid,
                    prompt_token_ids=tokens,
                    num_tokens=len(tokens),
                    kv_transfer_params=kv_params,
                )
            )
        now, waiting = [], []
        for req, (tokens, ids), have in zip(reqs, prompts, local, strict=True):
            n, background = self.scheduler.get_num_new_matched_tokens(req, have)
            n = n or 0
            assert not background or n > 0, "load_async must be False for a miss"
            self.scheduler.update_state_after_alloc(req, Blocks(ids), n)
            a = Admitted(req.request_id, n, background)
            out.append(a)
            if background:
                waiting.append((req, ids, a, have))
            else:
                now.append((req.request_id, ids, have + n, len(tokens) - have - n))
        first, failed = self._run(step_output(now))
        for a, (_, ids, _, _) in zip((a for a in out if not a.background), now, strict=True):
            a.failed = {b for b in failed if b in ids}
        if between is not None:
            between(self, out)
        t0 = time.monotonic()
        pending = {a.rid: (req, ids, a) for req, ids, a, _ in waiting}

        def landed(done: set[str], failed: set[int]) -> None:
            for rid in done:
                _, ids, a = pending.pop(rid)
                a.waited_s = time.monotonic() - t0
                a.failed = {b for b in failed if b in ids}

        # A load may land within the step that started it (vLLM takes that report: the
        # request waits for remote KVs from that step's schedule on).
        landed(first, failed)
        while pending:
            assert time.monotonic() - t0 < wait_s, (
                f"background loads never reported: {set(pending)}"
            )
            landed(*self._run(step_output([])))
            for _, _, a in pending.values():
                a.steps += 1
            if pending:
                time.sleep(0.002)
        later = []
        for req, ids, a, have in waiting:
            bad = [i for i, b in enumerate(ids) if b in a.failed]
            done_tokens = have + a.told
            computed = min(done_tokens, bad[0] * BS) if bad else done_tokens
            # vLLM allocates for it again (nothing external now) and schedules the rest.
            self.scheduler.update_state_after_alloc(req, Blocks(ids), 0)
            later.append((a.rid, ids, computed, len(req.prompt_token_ids) - computed))
        if later:
            self._run(step_output(later))
        for req in reqs:
            self.scheduler.request_finished(req)
        left = set(self.scheduler._params) & {req.request_id for req in reqs}
        assert not left, f"the scheduler kept finished requests' parameters: {left}"
        return out

    def _run(self, output: Any) -> tuple[set[str], set[int]]:
        """One step of the model runner: loads, (the forward), saves, what finished."""
        # vLLM's count of the step's tokens: its requests', and decodes running beside them
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        output.total_num_scheduled_tokens += self.decoding
        meta = self.scheduler.build_connector_meta(output)
        assert isinstance(meta, KVStoreMeta)
        self.worker.handle_preemptions(meta)
        self.worker.bind(meta)
        self.worker.start_load_kv(meta)
        if output.num_scheduled_tokens and self.forward_waits:
            # The forward pass: each attention layer, in order, waits for its layer.
            assert self.worker.layout is not None
            for name in self.worker.layout.names:
                self.worker.wait_for_layer_load(name)
                self.forward_layers.append(name)
        self.worker.wait_for_save(meta)
        _, recving = self.worker.get_finished(output.finished_req_ids)
        failed = self.worker.get_block_ids_with_load_errors()
        self.last_failed = failed
        self.scheduler.update_connector_output(
            SimpleNamespace(invalid_block_ids=failed, finished_recving=recving or set())
        )
        return set(recving or ()), failed

    def zero(self, ids: list[int]) -> None:
        for view in self.cache.values():
            view[ids] = 0

    def same(self, a: list[int], b: list[int]) -> bool:
        """Blocks ``a`` hold the bytes of blocks ``b``, in every layer. Compared as bytes:
        a block that was never written may hold NaN patterns, never equal as floats."""
        u8 = torch.uint8
        return all(torch.equal(v[a].view(u8), v[b].view(u8)) for v in self.cache.values())

    def stats(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(scheduler, worker) counters since the last call."""
        s, w = self.scheduler.get_stats(), self.worker.get_stats()
        return (s or KVStoreStats()).data, (w or KVStoreStats()).data

    def states(self) -> tuple[BreakerState, BreakerState]:
        return self.scheduler.client.breaker.state, self.worker.client.breaker.state

    def breakers(self) -> str:
        """Both breakers' state and last error, for failure messages."""
        s, w = self.scheduler.client.breaker, self.worker.client.breaker
        return f"scheduler {s.snapshot()}, worker {w.snapshot()}"

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
