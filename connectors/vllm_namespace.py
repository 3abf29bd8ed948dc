"""The engine's namespace, derived the same way in the scheduler and in every worker."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from kvstore.errors import ConfigError
from kvstore.keys import Fingerprint, Namespace

_DIGITS = re.compile(r"(\d+)")


def layer_order(names: Iterable[str]) -> list[str]:
    """The order of a chunk payload's layers: by name, numbers by value, which is the
    forward pass's order for vLLM's names (``model.layers.2...`` before
    ``model.layers.10...``), so a load copied layer by layer has each layer in place
    before the forward pass reaches it."""
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in _DIGITS.split(n)])


# In the layout of a model whose layer_order differs from plain sorted order (more than
# ten layers): payloads before it were in sorted order, and must not be read as these.
_BY_NUMBER = "layers-by-number"


@dataclass(frozen=True)
class Group:
    """One KV-cache group of vLLM's hybrid memory allocator (HMA): layers that share one
    block table. Each group's blocks are stored under keys of their own (its namespace)."""

    layers: tuple[str, ...]  # its layers' names, as register_kv_caches gets them
    window: int = 0  # sliding window in tokens; 0: full attention (every token kept)


@dataclass(frozen=True)
class EngineNamespace:
    """The engine's namespace; requests add their cache salt and LoRA to it."""

    base: Namespace
    # MLA under tensor parallelism: every TP rank holds the same latent KV, so the
    # namespace has no TP rank (one copy serves every rank) and only rank 0 writes it.
    shared_tp: bool = False
    writer: bool = True  # False: this worker loads the shared copy but never stores it

    def of_group(self, g: int) -> EngineNamespace:
        """KV-cache group ``g``'s namespace (hybrid models): the engine's layout, which
        describes every group, and the group's index, so each group's keys are its own."""
        return replace(self, base=replace(self.base, layout=f"{self.base.layout}/group{g}"))

    def for_request(self, salt: str) -> Namespace:
        if not salt:
            return self.base
        return replace(self.base, salt=f"{self.base.salt}|{salt}" if self.base.salt else salt)

    @property
    def fingerprint(self) -> Fingerprint:
        return self.base.fingerprint

    def describe(self) -> str:
        b = self.base
        tp = f"tp{b.tp_rank}/{b.tp_size}"
        if self.shared_tp:  # the namespace's tp_rank is 0 on every rank
            role = "written" if self.writer else "read"
            tp = f"tp*/{b.tp_size} (one copy for every rank, {role} here)"
        return f"{b.model} {b.dtype} {b.layout} {b.device} {tp} pp{b.pp_rank}/{b.pp_size}"


def _ranks(worker: bool) -> tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size); the scheduler looks up as rank 0."""
    if not worker:
        return 0, 0, 0, 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp, pp = get_tp_group(), get_pp_group()
        return tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size
    except Exception:  # not initialised (single process tests): rank 0 of 1
        return 0, 0, 0, 0


def _require_attention(group: Any) -> None:
    """Fail closed on state that is not attention KV: a Mamba or linear-attention layer's
    cache is one recurrent state per request, not per-token blocks, and loading it as
    blocks for a prefix would serve KV without the state that goes with it."""
    spec = group.kv_cache_spec
    try:
        from vllm.v1.kv_cache_interface import AttentionSpec

        attention = isinstance(spec, AttentionSpec)
    except ImportError:  # a vLLM without the class: go by the name
        attention = "Attention" in type(spec).__name__
    if not attention:
        raise ConfigError(
            f"kvstore stores attention KV only: this model keeps {type(spec).__name__} "
            "(recurrent state of Mamba or linear-attention layers), which kvstore cannot "
            "store or restore; run it without the kvstore connector"
        )


def _is_mla(spec: Any) -> bool:
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2): one latent vector per token,
    not split by heads, so every TP rank holds the same bytes."""
    try:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
    except ImportError:  # a vLLM without the class: go by the name
        return "MLA" in type(spec).__name__
    return isinstance(spec, MLAAttentionSpec)


def _window(spec: Any) -> int:
    """A sliding-window spec's window in tokens; 0 for full attention."""
    try:
        from vllm.v1.kv_cache_interface import SlidingWindowSpec
    except ImportError:  # a vLLM without the class: no windowed groups
        return 0
    return int(spec.sliding_window) if isinstance(spec, SlidingWindowSpec) else 0


def _require_hybrid_kind(group: Any, block_size: int) -> None:
    """Fail closed on a group of a hybrid model that kvstore does not know how to restore:
    it stores full-attention groups whole and sliding-window groups' windows, nothing
    else (chunked local attention keeps other blocks than a window's)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    spec = group.kv_cache_spec
    kinds = (FullAttentionSpec, SlidingWindowSpec)
    if type(spec) not in kinds or getattr(spec, "block_size", block_size) != block_size:
        raise ConfigError(
            f"kvstore serves hybrid models of full-attention and sliding-window groups of "
            f"one block size ({block_size}); this one has a group of {type(spec).__name__} "
            f"(block size {getattr(spec, 'block_size', '?')}): run it without the kvstore "
            "connector, or with --disable-hybrid-kv-cache-manager"
        )


def engine_groups(kv_cache_config: Any) -> tuple[Group, ...]:
    """vLLM's KV-cache groups as the connector handles them: each group's layers and,
    for a sliding-window group, its window."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return tuple(Group(tuple(g.layer_names), _window(g.kv_cache_spec)) for g in groups)


def engine_namespace(
    vllm_config: Any, kv_cache_config: Any, salt: str, *, worker: bool
) -> EngineNamespace:
    """Everything that changes the KV bytes, derived identically in both processes.

    The layout comes from ``kv_cache_config`` (both halves get the same one) and
    the platform, never from tensors only the worker sees, so the scheduler's
    lookups use the worker's keys.
    """
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    for g in groups:
        _require_attention(g)
    if len(groups) > 1:
        for g in groups:
            _require_hybrid_kind(g, cc.block_size)
    layout = [f"block{cc.block_size}"]
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        if i:  # several groups (HMA): every group's layout, in vLLM's group order
            layout.append(f"g{i}")
        layout += [type(spec).__name__, f"layers{len(group.layer_names)}"]
        for attr in ("num_kv_heads", "head_size", "head_size_v", "page_size_bytes"):
            if hasattr(spec, attr):
                layout.append(f"{attr}={getattr(spec, attr)}")
        if _window(spec):  # its records hold only a window's blocks
            layout.append(f"window={_window(spec)}")
    names = [n for g in groups for n in g.layer_names]
    if layer_order(names) != sorted(names):
        layout.append(_BY_NUMBER)
    layout.append(os.environ.get("VLLM_KV_CACHE_LAYOUT", ""))
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    tp_rank, tp_size, pp_rank, pp_size = _ranks(worker)
    tp_size = tp_size or pc.tensor_parallel_size
    # MLA's latent KV is the same on every TP rank: keyed without the rank, one copy serves
    # them all (TP rank 0 writes it), a TP-th of the bytes per-rank keys would store. The TP
    # size stays: the all-reduce's summation order changes the later layers' latent bits.
    shared = bool(groups) and all(_is_mla(g.kv_cache_spec) for g in groups)
    return EngineNamespace(
        Namespace(
            model=str(mc.model),
            revision=str(getattr(mc, "revision", None) or ""),
            dtype=dtype,
            layout="/".join(layout),
            device=str(current_platform.device_type),
            tp_rank=0 if shared else tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size or pc.pipeline_parallel_size,
            salt=salt,
        ),
        shared_tp=shared and tp_size > 1,
        writer=not shared or tp_rank == 0,
    )
