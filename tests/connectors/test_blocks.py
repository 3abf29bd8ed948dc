"""The connector's data path without vLLM: whole-block copies between a paged KV cache and
a real kvstore-server, and the background saver.

Runs on CPU everywhere and, where a GPU is present, on CUDA too (benchmarks/gpu_check.py
runs this file there): the stream ordering that keeps saves off the compute stream is
checked on the device itself, not assumed.
"""

from __future__ import annotations

import math
import mmap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from kvstore.connectors.vllm_blocks import BackgroundSaver, BlockLayout

from kvstore.errors import InvalidArgument
from kvstore.keys import ROOT, Namespace, chunk_key, tokens_to_bytes
from kvstore.records import make_header
from kvstore.sdk.client import Client
from kvstore.testing.server import KVServer
from kvstore.types import PutStatus

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Physical orders vLLM uses: CPU_ATTN's contiguous LBHNC, CUDA FlashAttention's LBNHC
# (a transposed, non-contiguous view), and layers interleaved inside a block (a block
# stride larger than a block), which KVCacheTensor's layer/block strides allow.
LAYOUTS = ["LBHNC", "LBNHC", "BLHNC"]


def make_cache(
    device: str,
    layout: str,
    *,
    layers: int = 3,
    blocks: int = 48,
    block_size: int = 16,
    heads: int = 2,
    head_dim: int = 32,
    fill: str = "random",
) -> dict[str, torch.Tensor]:
    """Per-layer logical ``[blocks, heads, block_size, 2*head_dim]`` views, as vLLM makes them.
    ``fill``: random, zeros, or empty (fresh pages never touched, as vLLM's large
    allocation is; on CPU from an anonymous mapping of its own: torch.empty may be served
    from freed heap holding old bytes)."""
    new = {"random": torch.randn, "zeros": torch.zeros, "empty": torch.empty}[fill]
    if fill == "empty" and device == "cpu":
        new = _untouched
    c = 2 * head_dim
    kw: dict[str, Any] = {"dtype": torch.bfloat16, "device": device}
    if layout == "LBHNC":
        base = new(layers, blocks, heads, block_size, c, **kw)
        views = [base[i] for i in range(layers)]
    elif layout == "LBNHC":
        base = new(layers, blocks, block_size, heads, c, **kw)
        views = [base[i].transpose(1, 2) for i in range(layers)]
    else:
        base = new(blocks, layers, heads, block_size, c, **kw)
        views = [base[:, i] for i in range(layers)]
    return {f"model.layers.{i}.attn": v for i, v in enumerate(views)}


def _untouched(*shape: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A CPU tensor over an anonymous mapping of its own: pages the kernel has not yet
    given, zero when first read. The tensor keeps the mapping alive."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8).view(dtype).view(shape)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVServer]:
    srv = KVServer(tmp_path_factory.mktemp("blocks"), memory="256MiB").start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server: KVServer) -> Iterator[Client]:
    with Client(server.unix_url, timeout=10) as c:
        yield c


NS = Namespace(model="test/blocks", dtype="bfloat16", layout="test")


def _put(client: Client, layout: BlockLayout, buf: torch.Tensor, blocks: int, salt: int) -> bytes:
    tokens = tokens_to_bytes(list(range(salt, salt + blocks * 16)))
    key = chunk_key(ROOT, NS.fingerprint, tokens)
    payload = buf.numpy()
    header = make_header(
        key=key,
        parent=ROOT,
        fingerprint=NS.fingerprint,
        token_bytes=tokens,
        dtype="bfloat16",
        shape=layout.payload_shape(blocks),
        payload=memoryview(payload.data),
    )
    assert client.put(header, payload).ok, "the server refused a well-formed chunk"
    return key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", LAYOUTS)
def test_blocks_round_trip_through_server(device: str, order: str, client: Client) -> None:
    src = make_cache(device, order)
    dst = make_cache(device, order, fill="zeros")
    a, b = BlockLayout(src), BlockLayout(dst)
    assert a.block_bytes == 2 * 16 * 64 * 2, "a block is heads * block_size * 2*head_dim bf16"
    picked, targets = [7, 3, 40, 41, 12], [0, 1, 2, 30, 47]
    buf = a.host_buffer(a.layers * len(picked) * a.block_bytes)
    a.gather(picked, buf)()
    key = _put(client, a, buf, len(picked), salt=100 * DEVICES.index(device) + LAYOUTS.index(order))
    got = b.host_buffer(buf.numel())
    header = client.get_into(key, got.numpy())
    assert header is not None and header.raw_size == buf.numel(), "the chunk was not found"
    b.scatter(got, len(picked), targets)
    if device == "cuda":
        torch.cuda.synchronize()
    for name in src:
        for s, t in zip(picked, targets, strict=True):
            assert torch.equal(src[name][s], dst[name][t]), f"{name}: block {s} -> {t} differs"
        untouched = [i for i in range(48) if i not in targets]
        assert not dst[name][untouched].any(), f"{name}: a block that was not loaded changed"


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_gathered_straight_into_a_reservation(device: str, client: Client) -> None:
    """The connector's in-place save: blocks gathered into reserved arena pages (CPU:
    hashed layer by layer as they land; CUDA: into the registered arena, hashed once the
    copy is done), committed with that checksum, read back byte for byte."""
    import xxhash
    from kvstore.connectors.vllm_blocks import PinnedArenas

    from kvstore.sdk.chunks import unsealed_header
    from kvstore.sdk.client import Reservation

    layout = BlockLayout(make_cache(device, "LBNHC"))
    picked = [5, 9, 2, 33]
    tokens = tokens_to_bytes(list(range(7000 + DEVICES.index(device), 7000 + 64)))[:256]
    key = chunk_key(ROOT, NS.fingerprint, tokens)
    header = unsealed_header(
        key, ROOT, NS.fingerprint, tokens, "bfloat16", layout.payload_shape(len(picked))
    )
    (res,) = client.reserve([header])
    assert isinstance(res, Reservation), f"no reservation: {res}"
    pins = PinnedArenas()
    try:
        view = res.contiguous()
        assert view is not None, "a fresh arena hands out one extent per record"
        if device == "cuda":
            assert pins.pin(res.arena), "cudaHostRegister of the arena failed"
        hasher = xxhash.xxh3_64() if device == "cpu" else None
        layout.gather(picked, torch.from_numpy(view), hasher)()
        assert res.commit(hasher.intdigest() if hasher else None) == PutStatus.STORED
        want = layout.host_buffer(layout.nbytes(len(picked)))
        layout.gather(picked, want)()
        got = torch.empty_like(want)
        assert client.get_into(key, got.numpy()) is not None, "the committed chunk is gone"
        assert torch.equal(got, want), "the chunk read back differs from the blocks gathered"
    finally:
        pins.close()


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_from_inside_a_chunk(device: str) -> None:
    """A load that starts inside a stored chunk takes its later blocks only."""
    src, dst = make_cache(device, "LBNHC"), make_cache(device, "LBNHC", fill="zeros")
    a, b = BlockLayout(src), BlockLayout(dst)
    buf = a.host_buffer(a.layers * 4 * a.block_bytes)
    a.gather([10, 11, 12, 13], buf)()
    b.scatter(buf, 4, [5, 6], first=2)
    for name in src:
        assert torch.equal(src[name][12:14], dst[name][5:7]), f"{name}: wrong blocks loaded"
        assert not dst[name][:5].any() and not dst[name][7:].any()
    with pytest.raises(InvalidArgument, match="chunk holding 4"):
        b.scatter(buf, 4, [1, 2, 3], first=2)


def test_layouts_that_cannot_be_copied_by_block_are_refused() -> None:
    cache = make_cache("cpu", "LBHNC")
    cache["model.layers.9.attn"] = torch.zeros(48, 2, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgument, match="one KV layout for every layer"):
        BlockLayout(cache)
    strided = torch.zeros(48, 2, 16, 128, dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(InvalidArgument, match="not one dense byte range"):
        BlockLayout({"layer": strided})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gather_is_ordered_with_the_compute_stream() -> None:
    """The side stream reads the step's writes, and later writes never reach the copy."""
    cache = make_cache("cuda", "LBNHC", blocks=256, block_size=16, heads=8, head_dim=64)
    layout = BlockLayout(cache)
    ids = list(range(0, 256, 2))
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        x = x @ x  # queue work ahead of the writes, so an unordered read would see old bytes
        x /= x.norm()
    for v in cache.values():
        v.fill_(7)  # "the step's KV writes"
    buf = layout.host_buffer(layout.layers * len(ids) * layout.block_bytes)
    wait = layout.gather(ids, buf)
    for v in cache.values():
        v.zero_()  # "the next step reuses the blocks": must not reach the copy
    wait()
    vals = buf.view(torch.bfloat16)
    assert bool((vals == 7).all()), "the saved bytes are not the ones the step wrote"
    torch.cuda.synchronize()
    assert not any(v.any() for v in cache.values())


# -- the background saver ---------------------------------------------------------------


def test_saver_runs_jobs_in_order_and_drains() -> None:
    done: list[int] = []

    def run(job: int) -> int:
        done.append(job)
        return 16

    saver = BackgroundSaver(run, max_pending_bytes=1 << 20)
    for i in range(50):
        assert saver.submit(lambda i=i: i, 100)
    assert saver.drain(10), "the saver did not finish 50 trivial jobs"
    assert done == list(range(50)), "jobs ran out of order"
    assert saver.take() == (50 * 16, 0) and saver.take() == (0, 0)
    assert saver.close(5)


def test_saver_refuses_beyond_its_buffer_and_counts_failures() -> None:
    gate = threading.Event()

    def run(job: str) -> int:
        gate.wait(10)
        if job == "bad":
            raise RuntimeError("put failed")
        return 1

    made: list[str] = []

    def job(name: str) -> Callable[[], str]:
        def make() -> str:
            made.append(name)
            return name

        return make

    saver = BackgroundSaver(run, max_pending_bytes=1000)
    assert saver.submit(job("a"), 600, key="a")
    assert saver.submit(job("bad"), 300, key="bad")
    assert not saver.submit(job("c"), 200), "a job past the buffer was queued (memory unbounded)"
    assert made == ["a", "bad"], "a refused job must not be built (no buffer, no copy)"
    assert saver.pending == 2 and saver.queued("a") and not saver.queued("c")
    assert not saver.drain(0.05), "drain returned while jobs were blocked"
    gate.set()
    assert saver.drain(10)
    assert not saver.queued("a"), "a finished job's key must be released"
    assert saver.take() == (1, 1), "one save and one failure were expected"
    assert saver.submit(job("big"), 5000), "an oversize job must still run when nothing is pending"
    assert saver.drain(10) and saver.take() == (1, 0)
    assert saver.close(10)


def test_saver_counts_unstored_jobs_and_releases_a_job_that_fails_to_build() -> None:
    saver = BackgroundSaver(lambda job: job, max_pending_bytes=100)
    assert saver.submit(lambda: 0, 10), "a job that stores nothing still runs"
    assert saver.drain(10) and saver.take() == (0, 1), "a put that stored nothing is a failure"

    def broken() -> int:
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        saver.submit(broken, 90, key="k")
    assert saver.pending == 0 and not saver.queued("k"), "a failed build must give its bytes back"
    assert saver.submit(lambda: 5, 100), "the budget must be whole again"
    assert saver.close(10)


def test_saver_close_gives_up_on_a_stuck_job() -> None:
    gate = threading.Event()
    saver = BackgroundSaver(lambda job: gate.wait(30) and 0, max_pending_bytes=10)
    saver.submit(lambda: "stuck", 1)
    t0 = time.monotonic()
    assert not saver.close(0.2), "close claimed a stuck job had finished"
    assert time.monotonic() - t0 < 5, "close waited past its timeout"
    gate.set()
