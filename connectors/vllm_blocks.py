"""Whole-block byte copies between vLLM's paged KV cache and chunk payloads.

vLLM 0.32 gives each layer a logical ``[num_blocks, ...]`` view over one shared
allocation whose physical order depends on the attention backend (LBHNC on CPU,
LBNHC for CUDA FlashAttention), and on CPU the bytes inside a block are packed
by the kernel, so per-token slicing is wrong (vllm-notes.md section 2). What is
always right is to move a block's bytes as they are: each layer is re-viewed
here as ``[num_blocks, block_bytes]`` over its storage, using its block stride,
and blocks are gathered or scattered with one ``index_select``/``index_copy_``
per layer. A chunk payload is ``[layers, blocks, block_bytes]`` in sorted
layer-name order; its first m blocks are a valid payload for m blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import torch

from kvstore.errors import InvalidArgument


def _dense_inner(t: torch.Tensor) -> bool:
    """Dims 1.. of ``t`` cover one dense region (in some order), so a block is contiguous bytes."""
    dims = sorted((t.stride(i), t.shape[i]) for i in range(1, t.dim()) if t.shape[i] > 1)
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return False
        expect *= size
    return True


class BlockLayout:
    """Byte views of every layer's blocks, and gather/scatter of whole blocks."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise InvalidArgument("no KV cache tensors were registered")
        self.names = sorted(kv_caches)
        self.views: list[torch.Tensor] = []
        first = kv_caches[self.names[0]]
        self.dtype = first.dtype
        self.device = first.device
        self.itemsize = first.element_size()
        self.block_bytes = prod(first.shape[1:]) * self.itemsize
        self.num_blocks = first.shape[0]
        for name in self.names:
            t = kv_caches[name]
            bb = prod(t.shape[1:]) * t.element_size()
            if bb != self.block_bytes or t.dtype != self.dtype or t.shape[0] != self.num_blocks:
                raise InvalidArgument(
                    f"layer {name}: {tuple(t.shape)} {t.dtype} differs from {self.names[0]}; "
                    "kvstore needs one KV layout for every layer (hybrid models are not supported)"
                )
            if not _dense_inner(t) or t.stride(0) * t.element_size() < bb:
                raise InvalidArgument(
                    f"layer {name}: a block is not one dense byte range (shape {tuple(t.shape)}, "
                    f"strides {t.stride()}); this KV layout is not supported"
                )
            storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            self.views.append(
                torch.as_strided(
                    storage,
                    (t.shape[0], bb),
                    (t.stride(0) * t.element_size(), 1),
                    t.storage_offset() * t.element_size(),
                )
            )

    @property
    def layers(self) -> int:
        return len(self.views)

    def describe(self) -> str:
        """The part of the namespace that the bytes depend on."""
        return (
            f"{self.layers}x{self.num_blocks and self.block_bytes}B/"
            f"{str(self.dtype).removeprefix('torch.')}/{self.device.type}"
        )

    def payload_shape(self, n_blocks: int) -> tuple[int, int, int]:
        """The chunk payload's shape in elements of the KV dtype."""
        return (self.layers, n_blocks, self.block_bytes // self.itemsize)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks into ``out``, a uint8 tensor of ``layers * len(block_ids) * block_bytes``."""
        n = len(block_ids)
        dst = out.view(self.layers, n, self.block_bytes)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, view in enumerate(self.views):
            if view.device == dst.device:
                torch.index_select(view, 0, idx, out=dst[i])
            else:  # GPU cache into a host buffer: gather on device, then one copy
                dst[i].copy_(torch.index_select(view, 0, idx), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def scatter(self, src: torch.Tensor, stored_blocks: int, block_ids: Sequence[int]) -> None:
        """Copy the first ``len(block_ids)`` blocks of a payload into the cache."""
        n = len(block_ids)
        if n > stored_blocks:
            raise InvalidArgument(f"asked for {n} blocks of a chunk holding {stored_blocks}")
        data = src.view(self.layers, stored_blocks, self.block_bytes)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, view in enumerate(self.views):
            part = data[i, :n]
            if part.device != view.device:
                part = part.to(view.device, non_blocking=True)
            view.index_copy_(0, idx, part)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
