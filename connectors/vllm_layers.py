"""A step's loads copied one layer at a time beside the forward pass (CPU engines, loads
of ``load_by_layer_bytes`` or more: on this host a smaller one costs less copied by two
threads before the forward pass, since the copy beside it slows the forward pass too).

A load in the step used to copy every layer of every chunk before the forward pass
began: at 16k tokens that copy was a quarter of the warm time to first token. Now the
engine thread only plans the copies and makes the one AcquireMany; a copying thread (on
the core vLLM leaves free, ``vllm_cpus``) copies layer 0 of every chunk, then layer 1,
and so on, while the forward pass runs, and each attention layer waits in
``wait_for_layer_load`` for its own layer only. The payload's layers are in the forward
pass's order (``layer_order``), so the copy stays ahead of the computation.

Each payload is still hashed as one stream as it lands (``ScatterBatch``), so its
verdict comes after the forward pass has used it. A payload that does not verify is
reported as failed blocks in the same step, and vLLM (``kv_load_failure_policy:
recompute``) drops the token that step sampled for the request and computes the blocks
again: the engine never emits a token computed from bytes that did not verify.

The same goes for any doubt: a layer the forward pass read without waiting for it (an
attention that does not call ``wait_for_layer_load``), or a layer not copied within the
call timeout, fails the whole batch, and a batch whose layers went unwaited turns layer
by layer loading off for the engine's life (``Loads.by_layer``).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.sdk import ScatterBatch

if TYPE_CHECKING:  # vllm_loads runs these: imported here for their types only
    from .vllm_copies import ChunkTask
    from .vllm_loads import Loads, SpecOutcome
    from .vllm_meta import LoadSpec


class LayerCopy:
    """One batch's copy, layer by layer, on a copying thread; ``wait`` is the forward
    pass's side, ``join`` the verdict once the forward pass is over."""

    def __init__(
        self, batch: ScatterBatch, pool: concurrent.futures.ThreadPoolExecutor, timeout: float
    ) -> None:
        self.batch = batch
        self.timeout = timeout  # the longest one wait may take (the call timeout)
        self.started = time.perf_counter()
        self.copied_s = 0.0  # from ``started`` to the last layer landed
        self.waited_s = 0.0  # how long the forward pass waited for layers
        self.waited: set[int] = set()  # the layers the forward pass waited for
        self.late = False  # a wait ran out: the forward pass read a layer still landing
        self._cond = threading.Condition()
        self._done = 0  # layers landed, in order
        self._over = False  # the copying thread is done (all landed, stopped, or failed)
        self._stop = False
        self.error: BaseException | None = None
        self._future = pool.submit(self._run)

    def _run(self) -> None:
        try:
            for k in range(self.batch.parts):
                with self._cond:
                    if self._stop:
                        return
                self.batch.copy(k)
                with self._cond:
                    self._done = k + 1
                    self._cond.notify_all()
            self.copied_s = time.perf_counter() - self.started
        except BaseException as e:  # reported by join: every chunk fails, nothing hangs
            self.error = e
        finally:
            with self._cond:
                self._over = True
                self._cond.notify_all()

    def wait(self, layer: int) -> None:
        """Return once layer ``layer`` has landed (or the copy is over, or the wait ran
        out: then the batch fails, and nothing past the layer landing now is copied)."""
        self.waited.add(layer)
        with self._cond:
            if self._done > layer or self._over:
                return
            t0 = time.perf_counter()
            landed = self._cond.wait_for(lambda: self._done > layer or self._over, self.timeout)
            self.waited_s += time.perf_counter() - t0
            if not landed:
                self.late = self._stop = True

    def join(self) -> list[bool] | None:
        """After the forward pass: wait for the copying thread (at most the layer it is
        on), then each chunk's verdict in ``ScatterBatch.add`` order; None when the batch
        failed whole (the copy raised, was stopped, or a layer went unwaited)."""
        self._future.result()
        # ``late`` is not ``_done < parts``: a wait that ran out on the last layer leaves
        # the copy to finish it, after the forward pass read it.
        if self.error is not None or self.late or self._done < self.batch.parts:
            return None
        return None if self.unwaited else self.batch.verified()

    @property
    def unwaited(self) -> bool:
        """The forward pass read some layer without waiting for it."""
        return len(self.waited) < self.batch.parts


class LoadJob:
    """One batch's loads, under way until ``finish``: a layer by layer copy (``copy``)
    may still be landing beside the forward pass."""

    def __init__(self, loads: Loads, specs: Sequence[LoadSpec], outs: list[SpecOutcome]) -> None:
        self.specs, self.outs = specs, outs
        self.loaded: set[tuple[int, int]] = set()  # (spec, block) written and verified
        self.copy: LayerCopy | None = None
        self.by_layer: list[ChunkTask] = []  # the chunks ``copy`` copies, in its order
        self._loads = loads
        self.unwaited = False  # the forward pass read a layer without waiting for it

    def wait(self, layer: int) -> None:
        """Return once layer ``layer`` (in ``BlockLayout.names`` order) has landed."""
        if self.copy is not None:
            self.copy.wait(layer)

    def finish(self) -> list[SpecOutcome]:
        """Wait for every copy, and say per spec what was loaded and what failed."""
        copy, self.copy = self.copy, None
        if copy is not None:
            verdicts = copy.join()
            self.unwaited = copy.unwaited
            if copy.error is not None:
                self._loads.client.failed("load", copy.error)
            for t, ok in zip(self.by_layer, verdicts or [False] * len(self.by_layer), strict=True):
                if ok:
                    self._loads._landed(t, None, self.loaded)
                elif verdicts is not None:
                    self._loads._scrub(t)
        return self._loads._outcomes(self)
