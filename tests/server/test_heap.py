"""Full garbage collections kept short (``server/heap.py``, ``gc_pause_ms``): what is alive
once the store is open is frozen, and again after any full collection that took longer
than the setting, so a full collection walks only what came to live since."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.errors import ConfigError
from kvstore.testing.server import KVServer
from server.config import ServerConfig
from server.heap import ShortCollections, keep_full_collections_short


@pytest.fixture
def thawed() -> Iterator[None]:
    """The test process's collector as it was: nothing frozen, no callback of ours."""
    yield
    for cb in [cb for cb in gc.callbacks if isinstance(cb, ShortCollections)]:
        gc.callbacks.remove(cb)
    gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


class _Ticks:
    """A clock that reads the times it is given, one per call. They are set in place
    (``times[:] = ...``): an object replaced would leave the frozen ones' count."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self) -> float:
        return self.times.pop(0)


def test_what_is_alive_at_the_start_is_frozen_and_a_long_collection_freezes_again(
    thawed: None,
) -> None:
    ticks = _Ticks()
    short = keep_full_collections_short(5.0, clock=ticks)
    assert short is not None and short in gc.callbacks
    at_start = gc.get_freeze_count()
    assert at_start > 1000, f"only {at_start} objects frozen: the start's objects were not"
    kept = [_Cycle() for _ in range(100)]  # alive: frozen by the next long collection
    garbage = [_Cycle() for _ in range(1000)]
    del garbage  # cycles: only the collector frees them

    ticks.times[:] = [0.0, 0.001]  # a full collection of 1 ms: short, nothing frozen
    gc.collect()
    assert short.freezes == 0 and gc.get_freeze_count() == at_start

    ticks.times[:] = [0.0, 0.010]  # 10 ms: what survived it is frozen
    gc.collect()
    assert short.freezes == 1
    grown = gc.get_freeze_count() - at_start
    assert 100 <= grown < 600, (
        f"{grown} objects frozen by the long collection: the 100 alive, not the garbage "
        "it had just collected"
    )
    assert all(k.me is k for k in kept)

    ticks.times[:] = [0.0, 0.010]
    gc.collect(1)  # a young collection is never one to freeze after
    assert short.freezes == 1
    short.remove()
    assert short not in gc.callbacks


def test_zero_leaves_the_collector_alone(thawed: None) -> None:
    before = (gc.get_freeze_count(), list(gc.callbacks))
    assert keep_full_collections_short(0) is None
    assert (gc.get_freeze_count(), list(gc.callbacks)) == before
    with pytest.raises(ConfigError, match=r"gc_pause_ms=-1.*>= 0"):
        ServerConfig(gc_pause_ms=-1)


@pytest.mark.parametrize("pause", ["5", "0"])
def test_the_server_freezes_its_start_unless_told_not_to(
    make_server: Callable[..., Any], pause: str
) -> None:
    srv: KVServer = make_server(
        f"heap-{pause}", args=["--log-level", "debug"], env={"KVSTORE_GC_PAUSE_MS": pause}
    ).start()
    assert srv.stop() == 0, srv.log()
    froze = "objects alive at the start frozen" in srv.log()
    assert froze == (pause != "0"), srv.log()
